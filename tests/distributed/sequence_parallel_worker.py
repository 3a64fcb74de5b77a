"""One rank of the 2-rank sequence-parallelism tests; started by tests/distributed/test_sequence_parallel.py.

    python -m torch.distributed.run --nproc_per_node 2 tests/distributed/sequence_parallel_worker.py <check> <dir>

Each case trains the same model three Adam steps through DeepSpeed at tensor-parallel size 2, once without and
once with sequence_parallel, on the same batches, and compares the losses of every step and the whole weights
after the last. Any difference raises, so a non-zero exit fails the test.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron.data import BatchOptions  # noqa: E402
from megatron.model import build_model, causal_lm_loss  # noqa: E402
from megatron.neox_arguments import NeoXArgs  # noqa: E402
from megatron.optim.optimizers import build_param_groups  # noqa: E402
from megatron.runtime.initialize import ModelParallelUnit  # noqa: E402
from tests.distributed.tensor_parallel_worker import (  # noqa: E402
    BASE,
    FAMILIES,
    VOCAB,
    check,
    full,
    run_named_check,
    set_tensor_parallel_size,
)
from tests.worker_report import report  # noqa: E402

SEQ = 12
STEPS = 3
# eps 1e-3: a first Adam step near lr x sign(gradient) would turn a rounding difference of a near-zero gradient into
# one of lr
RUN = dict(seq_length=SEQ, model_parallel_size=2, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=1,
           optimizer={"type": "Adam", "params": {"lr": 1e-2, "eps": 1e-3}}, zero_optimization={"stage": 1}, gradient_clipping=1.0)
LORA = dict(lora_rank=4, lora_alpha=8, lora_target_modules="all-linear")
EXPERTS = dict(moe_num_experts=4, moe_top_k=2, moe_router_type="topk", moe_intermediate_size=32,
               moe_shared_expert_intermediate_size=32)
CASES = {
    # LayerNorm with biases (their gradients are summed over the ranks too), parallel residual, dropout
    "neox dropout": ({**FAMILIES["neox"], "hidden_dropout": 0.1}, "lm"),
    "tied-learned recompute": ({**FAMILIES["tied-learned"], "checkpoint_activations": True}, "lm"),
    "qwen3-yarn": (FAMILIES["qwen3-yarn"], "lm"),
    "llama lora": ({**FAMILIES["llama"], **LORA}, "lm"),
    "llama experts": ({**FAMILIES["llama"], **EXPERTS}, "lm"),
    "llama dpo": (FAMILIES["llama"], "dpo"),
    "llama zero3": ({**FAMILIES["llama"], "zero_optimization": {"stage": 3}}, "lm"),
}


def batches(objective: str) -> list[dict[str, torch.Tensor]]:
    """The same samples on every rank, one micro batch per step."""
    generator = torch.Generator().manual_seed(11)
    samples = []
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (4, SEQ + 1), generator=generator)
        labels = tokens.clone()
        labels[:, :3] = -100
        samples.append({"pos": tokens[:2], "neg": tokens[2:], "pos_label": labels[:2], "neg_label": labels[2:]}
                       if objective == "dpo" else {"text": tokens, "label": labels})
    return samples


def loss_of(engine, objective, sample: dict[str, torch.Tensor]) -> torch.Tensor:
    if objective is not None:
        return objective(engine, sample)[0]
    tokens, labels = sample["text"], sample["label"]
    return causal_lm_loss(engine(tokens[:, :-1], parallel_output=True), labels[:, 1:].clamp(min=0),
                          (labels[:, 1:] >= 0).float(), vocab_parallel=True)


def train(settings: dict, objective_name: str, sequence_parallel: bool) -> tuple[list[float], dict]:
    from megatron.objectives.dpo import DirectPreferenceOptimization

    set_tensor_parallel_size(2)
    args = NeoXArgs.from_dict({**BASE, **RUN, **settings, "sequence_parallel": sequence_parallel,
                               "num_gpus": dist.get_world_size()})
    check(args.architecture().splits_sequence == sequence_parallel, "the architecture does not say the split")
    model = build_model(args.architecture(), args.seed, lora=args.lora())
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=build_param_groups(model, args.weight_decay),
                                           config=args.deepspeed_config(), mpu=ModelParallelUnit())
    objective = None
    if objective_name == "dpo":
        reference = build_model(args.architecture(), args.seed + 1).eval()
        objective = DirectPreferenceOptimization(BatchOptions(), 0.5, True, reference)
    losses = []
    torch.manual_seed(3)  # the dropout masks: the same draws in both runs
    for sample in batches(objective_name):
        loss = loss_of(engine, objective, sample)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, full({n: p.detach() for n, p in engine.module.named_parameters()}, model.arch)


def the_same_steps_as_without(_work_dir: Path) -> None:
    for case, (settings, objective) in CASES.items():
        losses_tp, weights_tp = train(settings, objective, sequence_parallel=False)
        losses_sp, weights_sp = train(settings, objective, sequence_parallel=True)
        check(all(abs(a - b) <= 1e-5 * max(1.0, abs(a)) for a, b in zip(losses_tp, losses_sp, strict=True)),
              f"{case}: losses {losses_sp} with sequence_parallel, {losses_tp} without")
        for name, value in weights_tp.items():
            check(torch.allclose(weights_sp[name], value, rtol=1e-5, atol=1e-5),
                  f"{case}: {name} after {STEPS} steps differs (max diff {(weights_sp[name] - value).abs().max()})")
        if dist.get_rank() == 0:
            report(case=case, losses=losses_sp, weights_compared=len(weights_tp))


CHECKS = {"steps": the_same_steps_as_without}


if __name__ == "__main__":
    run_named_check(CHECKS, {})
