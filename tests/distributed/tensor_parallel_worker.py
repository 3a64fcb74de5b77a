"""One rank of the 2-rank tensor-parallel tests; started by tests/distributed/test_tensor_parallel.py.

    python -m torch.distributed.run --nproc_per_node 2 tests/distributed/tensor_parallel_worker.py <check> <work dir>

Each 2-rank check builds the same model at tensor-parallel size 2 and then 1 (the two ranks as
data-parallel replicas) and compares them; the 4-rank check moves a checkpoint from size 2 to 4. Any
failed comparison raises, so a non-zero exit fails the test.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from deepspeed.utils import logger as deepspeed_logger  # noqa: E402
from megatron.core import parallel_state  # noqa: E402

from megatron.checkpointing import load_checkpoint, plan_load, save_checkpoint  # noqa: E402
from megatron.model import build_model, causal_lm_loss  # noqa: E402
from megatron.model.partitioning import partitioning, repartition  # noqa: E402
from megatron.neox_arguments import NeoXArgs  # noqa: E402
from megatron.optim.optimizers import build_param_groups  # noqa: E402
from megatron.runtime.initialize import ModelParallelUnit, init_deepspeed_distributed, leave_process_group  # noqa: E402
from tests.worker_report import report  # noqa: E402

VOCAB = 96
SEQ = 10
BASE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=SEQ, padded_vocab_size=VOCAB,
            hidden_dropout=0.0, attention_dropout=0.0, seed=77)
FAMILIES = {
    # GPT-NeoX / Pythia: LayerNorm with biases, GELU, partial rotary, parallel residual, untied output.
    "neox": dict(pos_emb="rotary", rotary_pct=0.25, gpt_j_residual=True, no_weight_tying=True,
                 norm="layernorm", activation="gelu", intermediate_size=64),
    # GPT-2 style: learned positions, sequential residual, tied embeddings.
    "tied-learned": dict(pos_emb="learned", gpt_j_residual=False, no_weight_tying=False, norm="layernorm",
                         activation="gelu", intermediate_size=64),
    # Llama: RMSNorm, SwiGLU, grouped-query attention, no biases, untied output.
    "llama": dict(pos_emb="rotary", rotary_pct=1.0, rotary_emb_base=10000, gpt_j_residual=False,
                  no_weight_tying=True, norm="rmsnorm", rms_norm_epsilon=1e-6, activation="swiglu",
                  intermediate_size=3 * 80, num_kv_heads=2, use_bias_in_norms=False,
                  use_bias_in_attn_linear=False, use_bias_in_mlp=False),
}
# Multi-query Llama: one key/value head, replicated on both ranks.
FAMILIES["llama-mqa"] = {**FAMILIES["llama"], "num_kv_heads": 1}
# Qwen3's per-head q/k norms (replicated weights on split heads), heads 32 wide, q/k/v biases and yarn,
# with the one key/value head replicated
FAMILIES["qwen3-yarn"] = {**FAMILIES["llama-mqa"], "qk_layernorm": True, "kv_channels": 32, "add_qkv_bias": True,
                          "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4}}


def check(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(f"rank {dist.get_rank()}: {message}")


def set_tensor_parallel_size(size: int) -> None:
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(size, 1)


def model_args(family: str, tp: int) -> NeoXArgs:
    # num_gpus: the worker's world (validation counts it against model_parallel_size)
    return NeoXArgs.from_dict({**BASE, **FAMILIES[family], "model_parallel_size": tp, "num_gpus": dist.get_world_size()})


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """The same tokens and labels on every rank."""
    tokens = torch.randint(0, VOCAB, (3, SEQ + 1), generator=torch.Generator().manual_seed(5))
    return tokens[:, :-1], tokens[:, 1:]


def full(named: dict[str, torch.Tensor], arch) -> dict[str, torch.Tensor]:
    """Whole tensors from every tensor-parallel rank's parts (collective over the tensor-parallel group)."""
    group = parallel_state.get_tensor_model_parallel_group()
    size = dist.get_world_size(group)
    result = {}
    for name, part in named.items():
        parts = [torch.empty_like(part) for _ in range(size)]
        dist.all_gather(parts, part.contiguous(), group=group)
        result[name] = repartition(parts, partitioning(name, arch), 0, 1)
    return result


def loss_and_grads(family: str, tp: int) -> tuple[torch.Tensor, dict, dict, torch.Tensor]:
    set_tensor_parallel_size(tp)
    args = model_args(family, tp)
    model = build_model(args.architecture(), args.seed)
    tokens, labels = batch()
    loss = causal_lm_loss(model(tokens, parallel_output=True), labels, vocab_parallel=True)
    loss.backward()
    with torch.no_grad():
        logits = model(tokens)
    weights = full({n: p.detach() for n, p in model.named_parameters()}, model.arch)
    grads = full({n: p.grad for n, p in model.named_parameters()}, model.arch)
    return loss.detach(), weights, grads, logits


def same_model_same_loss_and_gradients(_work_dir: Path) -> None:
    for family in FAMILIES:
        loss2, weights2, grads2, logits2 = loss_and_grads(family, 2)
        loss1, weights1, grads1, logits1 = loss_and_grads(family, 1)
        check(weights1.keys() == weights2.keys(), f"{family}: parameter names differ")
        for name in weights1:
            check(torch.equal(weights1[name], weights2[name]), f"{family}: initial {name} differs between TP 1 and 2")
        check(torch.allclose(loss1, loss2, rtol=1e-6, atol=1e-6), f"{family}: loss {loss2} at TP 2, {loss1} at TP 1")
        check(logits2.shape == logits1.shape, f"{family}: gathered logits have shape {tuple(logits2.shape)}")
        check(torch.allclose(logits1, logits2, rtol=1e-5, atol=1e-5), f"{family}: logits differ")
        for name in grads1:
            check(torch.allclose(grads1[name], grads2[name], rtol=1e-4, atol=1e-6),
                  f"{family}: gradient of {name} differs (max diff {(grads1[name] - grads2[name]).abs().max()})")
        if dist.get_rank() == 0:
            report(case=family, loss=loss1.item())


def preference_loss_and_grads(family: str, tp: int, train_impl: str) -> tuple[torch.Tensor, dict]:
    """DPO or KTO of a policy (seed 77) against a reference (seed 78) on the same batch at this TP size."""
    from megatron.data import BatchOptions
    from megatron.objectives.dpo import DirectPreferenceOptimization
    from megatron.objectives.kto import KahnemanTverskyOptimization

    set_tensor_parallel_size(tp)
    args = model_args(family, tp)
    policy = build_model(args.architecture(), args.seed)
    reference = build_model(args.architecture(), args.seed + 1).eval()
    tokens = torch.randint(0, VOCAB, (4, SEQ + 1), generator=torch.Generator().manual_seed(6))
    labels = tokens.clone()
    labels[:, :3] = -100
    if train_impl == "dpo":
        objective = DirectPreferenceOptimization(BatchOptions(), 0.5, True, reference)
        samples = {"pos": tokens[:2], "neg": tokens[2:], "pos_label": labels[:2], "neg_label": labels[2:]}
    else:
        objective = KahnemanTverskyOptimization(BatchOptions(), 0.5, True, 1.0, 1.0, reference)
        samples = {"text": tokens, "label": labels, "reward": torch.tensor([1.0, -1.0, -1.0, 1.0])}
    loss, _ = objective(policy, samples)
    loss.backward()
    return loss.detach(), full({n: p.grad for n, p in policy.named_parameters()}, policy.arch)


def preference_losses_match(_work_dir: Path) -> None:
    """DPO and KTO: loss and full gradients at TP 2 equal TP 1's (log-probs from the vocabulary slices)."""
    for train_impl in ("dpo", "kto"):
        for family in ("neox", "llama"):
            loss2, grads2 = preference_loss_and_grads(family, 2, train_impl)
            loss1, grads1 = preference_loss_and_grads(family, 1, train_impl)
            check(torch.allclose(loss1, loss2, rtol=1e-6, atol=1e-6),
                  f"{train_impl} {family}: loss {loss2} at TP 2, {loss1} at TP 1")
            for name in grads1:
                check(torch.allclose(grads1[name], grads2[name], rtol=1e-4, atol=1e-6),
                      f"{train_impl} {family}: gradient of {name} differs "
                      f"(max diff {(grads1[name] - grads2[name]).abs().max()})")
            if dist.get_rank() == 0:
                report(case=f"{train_impl} {family}", loss=loss1.item())


def engine_step(family: str, tp: int, stage: int, clipping: float) -> tuple[float | None, dict]:
    set_tensor_parallel_size(tp)
    args = model_args(family, tp)
    model = build_model(args.architecture(), args.seed)
    config = {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "eps": 1.0}}, "gradient_clipping": clipping,
              "zero_optimization": {"stage": stage}, "steps_per_print": 10**9}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                           mpu=ModelParallelUnit())
    tokens, labels = batch()
    loss = causal_lm_loss(engine(tokens, parallel_output=True), labels, vocab_parallel=True)
    engine.backward(loss)
    engine.step()
    weights = full({n: p.detach() for n, p in engine.module.named_parameters()}, model.arch)
    norm = engine.get_global_grad_norm()  # None where DeepSpeed does not record it (ZeRO 0 in fp32)
    return None if norm is None else float(norm), weights


def deepspeed_step_matches(work_dir: Path) -> None:
    """One clipped Adam step through DeepSpeed (given the mpu) moves the full model as at TP 1.

    Adam's eps of 1 makes the first step about lr x gradient, so the step follows the clipping,
    which scales by the global norm: a norm that missed a rank's shards would move other weights.
    """
    for family in ("neox", "llama", "llama-mqa"):
        # DeepSpeed's norm counts a replicated key/value head once per rank holding it, so the
        # multi-query model's step is compared unclipped (see docs/architecture.md).
        clipping = 0.0 if family == "llama-mqa" else 0.05
        for stage in (0, 1):
            norm2, weights2 = engine_step(family, 2, stage, clipping)
            norm1, weights1 = engine_step(family, 1, stage, clipping)
            check(stage == 0 or norm1 is not None, f"{family} ZeRO {stage}: no gradient norm recorded")
            check(not clipping or norm1 is None or abs(norm1 - norm2) <= 1e-5 * norm1,
                  f"{family} ZeRO {stage}: grad norm {norm2} at TP 2, {norm1} at TP 1")
            for name in weights1:
                check(torch.allclose(weights1[name], weights2[name], rtol=1e-5, atol=1e-6),
                      f"{family} ZeRO {stage}: {name} after one step differs")
            if dist.get_rank() == 0:
                report(case=f"{family} zero{stage}", grad_norm=norm1)
    hf_folder_at_tp2_has_the_gradient_of_transformers(work_dir)


def hf_folder_engine_at_tp2(kind: str, work_dir: Path):
    """A tiny ``kind`` folder saved by transformers (the same seed on both ranks: the same model) and an engine
    fine-tuning it at TP 2, loaded through the load plan: (transformers' model, its spec, the settings, the
    engine)."""
    from megatron.hf import HF_FOLDER
    from megatron.hf.config import spec_from_hf_config
    from tests.e2e.test_hf_conversion import make_hf_model, save_hf

    model = make_hf_model(kind)
    hf_dir = work_dir / kind
    if dist.get_rank() == 0:
        save_hf(model, hf_dir)
    dist.barrier()
    spec = spec_from_hf_config(model.config.to_dict())
    args = NeoXArgs.from_dict({
        **spec.settings, "padded_vocab_size": spec.vocab_size, "model_parallel_size": 2,
        "num_gpus": dist.get_world_size(), "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
        "train_iters": 1, "hidden_dropout": 0.0, "attention_dropout": 0.0, "gradient_clipping": 0.0,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-6}}, "zero_optimization": {"stage": 0},
        "load": str(hf_dir), "finetune": True})
    engine = trained_engine(args, args.seed)
    load_checkpoint(engine, plan_load(args, 1, hf_source=HF_FOLDER))
    return model, spec, args, engine


def hf_folder_at_tp2_has_the_gradient_of_transformers(work_dir: Path) -> None:
    """A Qwen3 folder saved by transformers, fine-tuned at TP 2 through the load plan: the first step's loss
    and full gradients are transformers' own on the same batch."""
    from megatron.hf.mapping import convert_tensors, hf_to_ours

    model, spec, args, engine = hf_folder_engine_at_tp2("qwen3", work_dir)
    tokens = torch.randint(0, spec.vocab_size, (2, 41), generator=torch.Generator().manual_seed(3))
    loss = causal_lm_loss(engine(tokens[:, :-1], parallel_output=True), tokens[:, 1:], vocab_parallel=True)
    engine.backward(loss)
    grads = full({n: p.grad for n, p in engine.module.named_parameters()}, engine.module.arch)
    model.train()
    expected_loss = model(input_ids=tokens, labels=tokens).loss
    expected_loss.backward()
    expected = convert_tensors(((n, p.grad) for n, p in model.named_parameters()),
                               hf_to_ours(spec.family, spec.architecture()), "transformers' gradients")
    check(abs(loss.item() - expected_loss.item()) <= 1e-5, f"qwen3 at TP 2: loss {loss.item()}, "
          f"transformers' {expected_loss.item()}")
    check(grads.keys() == expected.keys(), "qwen3 at TP 2: other parameters than transformers'")
    for name, grad in expected.items():
        check(torch.allclose(grads[name], grad, rtol=1e-4, atol=1e-6),
              f"qwen3 at TP 2: gradient of {name} differs (max diff {(grads[name] - grad).abs().max()})")
    if dist.get_rank() == 0:
        report(case="qwen3 folder at tp2", loss=loss.item(), gradients=len(grads))


def trained_engine(args: NeoXArgs, seed: int):
    set_tensor_parallel_size(args.model_parallel_size)
    model = build_model(args.architecture(), seed)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=build_param_groups(model, args.weight_decay),
                                           config=args.deepspeed_config(), mpu=ModelParallelUnit())
    return engine


def module_only_load_from_tp2_to_tp4(work_dir: Path) -> None:
    """4 ranks: a Llama with 2 key/value heads trains a step at TP 2 x DP 2 and saves; a run at TP 4 (each
    key/value head on two ranks) loads it module-only through the load plan, which checks the stored
    logits and the fp32 masters; the logits and the full weights are those of the TP 2 model."""
    run = dict(train_micro_batch_size_per_gpu=3, gradient_accumulation_steps=1, train_iters=2, precision="fp32",
               optimizer={"type": "Adam", "params": {"lr": 1e-2}}, zero_optimization={"stage": 1},
               checkpoint_validation_with_forward_pass=True, num_gpus=dist.get_world_size())
    settings = {**BASE, **FAMILIES["llama"], **run}
    tokens, labels = batch()
    args2 = NeoXArgs.from_dict({**settings, "model_parallel_size": 2, "save": str(work_dir)})
    engine = trained_engine(args2, args2.seed)
    engine.backward(causal_lm_loss(engine(tokens, parallel_output=True), labels, vocab_parallel=True))
    engine.step()
    engine.eval()
    with torch.no_grad():
        logits2 = engine(tokens)
    weights2 = full({n: p.detach() for n, p in engine.module.named_parameters()}, engine.module.arch)
    save_checkpoint(args2, engine, iteration=1, consumed_train_samples=6)

    args4 = NeoXArgs.from_dict({**settings, "model_parallel_size": 4, "load": str(work_dir), "finetune": True})
    engine = trained_engine(args4, args4.seed + 1)  # other weights than the checkpoint's until the load
    load_checkpoint(engine, plan_load(args4, 1))
    engine.eval()
    with torch.no_grad():
        logits4 = engine(tokens)
    weights4 = full({n: p.detach() for n, p in engine.module.named_parameters()}, engine.module.arch)
    for name, value in weights2.items():
        check(torch.equal(weights4[name], value), f"{name} differs after the TP 2 -> 4 load")
    check(torch.allclose(logits4, logits2, rtol=1e-5, atol=1e-5),
          f"logits differ after the TP 2 -> 4 load (max diff {(logits4 - logits2).abs().max()})")
    if dist.get_rank() == 0:
        report(case="tp2 -> tp4", tensors_equal=len(weights2), logits_off_by=float((logits4 - logits2).abs().max()))


CHECKS = {"equivalence": same_model_same_loss_and_gradients, "deepspeed": deepspeed_step_matches,
          "resplit4": module_only_load_from_tp2_to_tp4, "preference": preference_losses_match}
RANKS = {"resplit4": 4}


def run_named_check(checks: dict, ranks: dict[str, int]) -> None:
    """Run the check named by argv[1] on the work dir argv[2] at its rank count (2 unless `ranks` says), and
    record that it passed; the process group is left after it."""
    name = sys.argv[1]
    deepspeed_logger.setLevel(logging.ERROR)
    init_deepspeed_distributed(dist_backend="gloo")
    check(dist.get_world_size() == ranks.get(name, 2), f"{name} expects {ranks.get(name, 2)} ranks")
    checks[name](Path(sys.argv[2]))
    dist.barrier()
    if dist.get_rank() == 0:
        report(check=name, ok=True)
    leave_process_group()


if __name__ == "__main__":
    run_named_check(CHECKS, RANKS)
