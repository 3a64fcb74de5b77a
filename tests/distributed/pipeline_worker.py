"""One rank of the 2-rank pipeline tests; started by tests/distributed/test_pipeline.py.

    python -m torch.distributed.run --nproc_per_node 2 tests/distributed/pipeline_worker.py <check> <work dir>

The check builds each model family once as one module (``build_model``, pipe_parallel_size 1, on every
rank) and once as 2 pipeline stages through DeepSpeed's pipe engine, runs the same batch (2 micro batches)
through both and compares weights, loss and gradients; any failed comparison raises.
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

from megatron.data import BatchOptions, get_batch  # noqa: E402
from megatron.model import build_model, causal_lm_loss  # noqa: E402
from megatron.model.pipeline import build_pipeline_model  # noqa: E402
from megatron.neox_arguments import NeoXArgs  # noqa: E402
from megatron.objectives import mean_over_micro_batches_and_ranks  # noqa: E402
from megatron.objectives.language_model import LanguageModelLoss  # noqa: E402
from megatron.runtime.initialize import init_deepspeed_distributed, leave_process_group  # noqa: E402
from megatron.training.pipe_engine import pipeline_batches, train_step  # noqa: E402
from tests.distributed.tensor_parallel_worker import BASE, FAMILIES, SEQ, VOCAB, check, full  # noqa: E402
from tests.worker_report import report  # noqa: E402

MICRO, MICRO_BATCHES = 2, 2
# fp32 on CPU; the two sides sum the same products in the same order except where a stage boundary
# or the tied embedding's two gradient halves (summed by DeepSpeed's tied all-reduce) meet.
LOSS_TOLERANCE = 1e-6
GRAD_RTOL, GRAD_ATOL = 1e-5, 1e-7


def set_groups(pipe: int, tensor: int = 1) -> None:
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor, pipe)


def micro_batches() -> list[dict[str, torch.Tensor]]:
    tokens = torch.randint(0, VOCAB, (MICRO * MICRO_BATCHES, SEQ + 1), generator=torch.Generator().manual_seed(5))
    return [{"text": tokens[i * MICRO:(i + 1) * MICRO]} for i in range(MICRO_BATCHES)]


def ours(pipe_name: str) -> str:
    """The pipe module's parameter name as GPTModel names it."""
    if pipe_name.startswith("tied_modules.embed."):
        return "sequential.0." + pipe_name.removeprefix("tied_modules.embed.")
    return "sequential." + pipe_name


def one_module(args) -> tuple[float, dict, dict]:
    set_groups(1)
    model = build_model(args.architecture(), args.seed)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    losses = []
    for samples in micro_batches():
        batch = get_batch(samples, BatchOptions())
        loss = causal_lm_loss(model(batch.tokens, parallel_output=True), batch.labels, batch.loss_mask,
                              vocab_parallel=True) / MICRO_BATCHES
        loss.backward()
        losses.append(loss.detach())
    return float(sum(losses)), weights, {n: p.grad for n, p in model.named_parameters()}


def two_stages_engine(args, tensor: int = 1):
    """The pipe engine of 2 stages, and the gradients its step will see (whole, joined over the tensor-parallel
    group, named as GPTModel names them)."""
    set_groups(2, tensor)
    module = build_pipeline_model(args.architecture(), args.seed, 2, args.pipe_partition_method)
    arch = args.architecture()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.0)
    grads = {}
    optimizer.register_step_pre_hook(lambda *_: grads.update(
        full({ours(n): p.grad.detach().clone() for n, p in module.named_parameters()}, arch)))
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": MICRO_BATCHES,
              "steps_per_print": 10**9, "gradient_clipping": 0.0}
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=config)
    return engine, grads


def two_stages(args, tensor: int = 1) -> tuple[float, dict, dict, list[str]]:
    """Weights and gradients whole (joined over the tensor-parallel group), named as GPTModel names them."""
    engine, grads = two_stages_engine(args, tensor)
    module = engine.module
    weights = full({ours(n): p.detach().clone() for n, p in module.named_parameters()}, args.architecture())
    loss = engine.train_batch(pipeline_batches(iter(micro_batches()), BatchOptions()))
    files = sorted({name.split(".")[0] if not name.startswith("tied_modules") else "0" for name, _ in
                    module.named_parameters()}, key=int)
    return float(loss), weights, grads, files


def compare(family: str, tensor: int, checkpoint_activations: bool) -> None:
    settings = {**BASE, **FAMILIES[family], "num_layers": 3, "checkpoint_activations": checkpoint_activations}
    one = NeoXArgs.from_dict({**settings, "num_gpus": 1})
    loss1, weights1, grads1 = one_module(one)
    piped = NeoXArgs.from_dict({**settings, "pipe_parallel_size": 2, "model_parallel_size": tensor,
                                "num_gpus": dist.get_world_size()})
    loss2, weights2, grads2, positions = two_stages(piped, tensor)
    label = f"{family} at TP {tensor}"
    check(weights2 and set(weights2) <= set(weights1), f"{label}: stage names {sorted(set(weights2) - set(weights1))}")
    for name, weight in weights2.items():
        check(torch.equal(weight, weights1[name]), f"{label}: initial {name} differs from one module's")
    check(abs(loss1 - loss2) <= LOSS_TOLERANCE, f"{label}: loss {loss2} in 2 stages, {loss1} in one module")
    check(grads2.keys() == weights2.keys(), f"{label}: no gradient seen for every parameter")
    worst = 0.0
    for name, grad in grads2.items():
        if name == "sequential.0.position_embeddings.weight" and parallel_state.get_pipeline_model_parallel_rank() == 1:
            continue  # the last stage's copy of the tied embedding uses its word embeddings only
        worst = max(worst, float((grad - grads1[name]).abs().max()))
        check(torch.allclose(grad, grads1[name], rtol=GRAD_RTOL, atol=GRAD_ATOL),
              f"{label}: gradient of {name} differs (max diff {(grad - grads1[name]).abs().max()})")
    report(case=label, loss=float(loss1), two_stage_loss_off_by=float(abs(loss1 - loss2)), worst_gradient_off_by=worst,
           layer_positions=list(positions))


def equivalence(_work_dir: Path) -> None:
    """2 ranks: 2 stages; the Llama model also recomputes its activations (checkpoint_activations)."""
    for family in ("neox", "tied-learned", "llama"):
        compare(family, 1, checkpoint_activations=family == "llama")


def tensor_parallel(_work_dir: Path) -> None:
    """4 ranks: 2 stages x 2 tensor-parallel ranks."""
    for family in ("neox", "tied-learned", "llama"):
        compare(family, 2, checkpoint_activations=False)


# 4 experts in layers 0 and 2 of 4, so each stage holds one expert layer
EXPERTS = {"sinkhorn": dict(moe_num_experts=4, moe_expert_interval=2),
           "topk, balanced": dict(moe_num_experts=4, moe_expert_interval=2, moe_router_type="topk", moe_top_k=2,
                                  moe_load_balancing_loss=True, moe_load_balancing_loss_coef=0.5,
                                  checkpoint_activations=True)}


def compare_experts(router: str) -> None:
    """The language-model objective's step on one module and through 2 stages: the same loss, metrics (lm_loss,
    load_balancing_loss and every layer's expert load: the layers live on different stages) and gradients."""
    settings = {**BASE, **FAMILIES["llama"], "num_layers": 4, **EXPERTS[router]}
    one = NeoXArgs.from_dict({**settings, "num_gpus": 1})
    set_groups(1)
    model = build_model(one.architecture(), one.seed)
    weights1 = {n: p.detach().clone() for n, p in model.named_parameters()}
    objective = LanguageModelLoss(BatchOptions(), one.architecture())
    results = []
    for samples in micro_batches():
        loss, metrics = objective(model, samples)
        (loss / MICRO_BATCHES).backward()
        results.append((loss, metrics))
    loss1, metrics1 = mean_over_micro_batches_and_ranks(results)
    grads1 = {n: p.grad for n, p in model.named_parameters()}

    piped = NeoXArgs.from_dict({**settings, "pipe_parallel_size": 2, "num_gpus": dist.get_world_size()})
    engine, grads2 = two_stages_engine(piped)
    for name, weight in engine.module.named_parameters():
        check(torch.equal(weight, weights1[ours(name)]), f"{router}: initial {ours(name)} differs from one module's")
    loss2, metrics2 = train_step(engine, iter(micro_batches()), LanguageModelLoss(BatchOptions(), piped.architecture()))
    check(any(name.startswith("expert_load/layer_2/") for name in metrics1), f"{router}: {sorted(metrics1)}")
    check(metrics2 == metrics1, f"{router}: metrics through 2 stages {metrics2}, of one module {metrics1}")
    check(abs(loss1 - loss2) <= LOSS_TOLERANCE, f"{router}: loss {loss2} in 2 stages, {loss1} in one module")
    check(grads2 and set(grads2) <= set(grads1), f"{router}: stage names {sorted(set(grads2) - set(grads1))}")
    worst = 0.0
    for name, grad in grads2.items():
        worst = max(worst, float((grad - grads1[name]).abs().max()))
        check(torch.allclose(grad, grads1[name], rtol=GRAD_RTOL, atol=GRAD_ATOL),
              f"{router}: gradient of {name} differs (max diff {(grad - grads1[name]).abs().max()})")
    report(case=f"experts, {router}", loss=loss1, two_stage_loss_off_by=abs(loss1 - loss2), worst_gradient_off_by=worst,
           metrics=metrics1)


def experts(_work_dir: Path) -> None:
    """2 ranks: experts in both stages, with GPT-NeoX's sinkhorn router and with the top-k router and the
    load-balancing loss (its gradient reaches the first stage's router through the router statistics)."""
    for router in EXPERTS:
        compare_experts(router)


CHECKS = {"equivalence": equivalence, "tensor_parallel": tensor_parallel, "experts": experts}

if __name__ == "__main__":
    deepspeed_logger.setLevel(logging.WARNING)
    init_deepspeed_distributed()
    CHECKS[sys.argv[1]](Path(sys.argv[2]))
    dist.barrier()
    if dist.get_rank() == 0:
        report(check=sys.argv[1], ok=True)
    leave_process_group()
