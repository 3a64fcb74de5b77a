"""One rank of the 2-rank LoRA layout tests; started by tests/distributed/test_lora.py.

    python -m torch.distributed.run --nproc_per_node 2 tests/distributed/lora_worker.py <check> <work dir>

Each check takes the first step of a LoRA model (fp32, SGD at learning rate 1, so the step's change of a
weight is its gradient) in one layout and in the layout it must equal: tensor-parallel size 2 against 1, ZeRO-3
against ZeRO-0 over the same two data-parallel ranks. The adapters are set to random values first (a fresh B is
zero, and A's gradient with it), the same whole values in both layouts. Any failed comparison raises, so a
non-zero exit fails the test.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state  # noqa: E402

from megatron.checkpointing import load_checkpoint, plan_load, read_module_weights, save_checkpoint  # noqa: E402
from megatron.model import build_model, causal_lm_loss  # noqa: E402
from megatron.model.init_methods import full_shape, local_shape, set_value  # noqa: E402
from megatron.model.partitioning import REPLICATED, partition, partitioning, repartition  # noqa: E402
from megatron.model.zero3_partition import is_partitioned  # noqa: E402
from megatron.neox_arguments import NeoXArgs  # noqa: E402
from megatron.optim.optimizers import build_param_groups  # noqa: E402
from megatron.runtime.initialize import (  # noqa: E402
    ModelParallelUnit,
    zero3_construction,
)
from tests.distributed.tensor_parallel_worker import (  # noqa: E402
    BASE,
    FAMILIES,
    batch,
    check,
    run_named_check,
    set_tensor_parallel_size,
)
from tests.worker_report import report  # noqa: E402

LORA = dict(lora_rank=4, lora_alpha=12, lora_target_modules="all-linear")  # alpha != rank: the scaling shows
STEP = dict(train_micro_batch_size_per_gpu=3, gradient_accumulation_steps=1, train_iters=2, precision="fp32",
            optimizer={"type": "SGD", "params": {"lr": 1.0}}, zero_allow_untested_optimizer=True,
            gradient_clipping=0.0, weight_decay=0.0)
TOLERANCE = 1e-5


def lora_args(family: str, tp: int, zero_stage: int, **more) -> NeoXArgs:
    return NeoXArgs.from_dict({**BASE, **FAMILIES[family], **LORA, **STEP, "model_parallel_size": tp,
                               "zero_optimization": {"stage": zero_stage, "stage3_param_persistence_threshold": 0},
                               "num_gpus": dist.get_world_size(), **more})


def whole_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole, as tensor-parallel size 1 holds it (collective). A replicated parameter must be
    the same on every tensor-parallel rank: a replica that drifted would be a wrong gradient."""
    group = parallel_state.get_tensor_model_parallel_group()
    result = {}
    for name, param in model.named_parameters():
        with deepspeed.zero.GatheredParameters([param], enabled=is_partitioned(param)):
            part = param.detach().clone()
        parts = [torch.empty_like(part) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, part.contiguous(), group=group)
        p = partitioning(name, model.arch)
        check(p != REPLICATED or all(torch.equal(parts[0], other) for other in parts),
              f"replicated {name} differs between tensor-parallel ranks")
        result[name] = repartition(parts, p, 0, 1)
    return result


def random_adapters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Whole values (as at size 1) for every adapter weight, the same at every layout."""
    generator = torch.Generator().manual_seed(3)
    size = parallel_state.get_tensor_model_parallel_world_size()
    return {name: torch.randn(full_shape(local_shape(param), partitioning(name, model.arch), size),
                              generator=generator) * 0.3
            for name, param in model.named_parameters() if ".lora." in name}


def set_adapters(model: torch.nn.Module, values: dict[str, torch.Tensor], slice_of_rank: int) -> None:
    """Write rank ``slice_of_rank``'s part of ``values`` into this rank's adapters."""
    size = parallel_state.get_tensor_model_parallel_world_size()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in values:
                set_value(param, partition(values[name], partitioning(name, model.arch), slice_of_rank, size))


def engine_of(args: NeoXArgs, random: bool = False, swap_slices: bool = False) -> tuple:
    """(the engine of ``args``, its model's fresh weights whole). With ``random`` the adapters are set to
    ``random_adapters``, before the engine takes its optimizer's copy of them; ``swap_slices`` gives each of two
    tensor-parallel ranks the other's part: a wrong split, which a step must show."""
    set_tensor_parallel_size(args.model_parallel_size)
    config = args.deepspeed_config()
    partitioned_by = zero3_construction(config) if args.zero_stage == 3 else None
    model = build_model(args.architecture(), args.seed, partitioned_by=partitioned_by, lora=args.lora())
    fresh = whole_weights(model)
    if random:
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        set_adapters(model, random_adapters(model), 1 - tp_rank if swap_slices else tp_rank)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=build_param_groups(model, args.weight_decay),
                                           config=config, mpu=ModelParallelUnit())
    return engine, fresh


def first_step(args: NeoXArgs, swap_slices: bool = False) -> tuple[dict, dict, dict]:
    """(fresh weights, weights the step starts from, weights after it), all whole, from random adapters."""
    engine, fresh = engine_of(args, random=True, swap_slices=swap_slices)
    before = whole_weights(engine.module)
    tokens, labels = batch()  # the same on every rank: every data-parallel layout averages the same gradient
    engine.backward(causal_lm_loss(engine(tokens, parallel_output=True), labels, vocab_parallel=True))
    engine.step()
    return fresh, before, whole_weights(engine.module)


def update_offsets(reference: tuple[dict, dict, dict], other: tuple[dict, dict, dict]) -> dict[str, float]:
    """How far each adapter's update in ``other``'s step is from ``reference``'s (largest element)."""
    (_, before1, after1), (_, before2, after2) = reference, other
    return {name: ((before2[name] - after2[name]) - (before1[name] - value)).abs().max().item()
            for name, value in after1.items() if ".lora." in name}


def mismatches(reference: tuple[dict, dict, dict], other: tuple[dict, dict, dict]) -> list[str]:
    """Where ``other``'s step differs from ``reference``'s: an adapter's update off by more than TOLERANCE, or a
    base weight not bit-identical."""
    wrong = [f"{name} update off by {off:.2e}" for name, off in update_offsets(reference, other).items()
             if off > TOLERANCE]
    (_, _, after1), (_, before2, after2) = reference, other
    for name, value in after1.items():
        if ".lora." not in name and not (torch.equal(after2[name], value) and torch.equal(before2[name], after2[name])):
            wrong.append(f"base {name} differs or moved")
    return wrong


def tensor_parallel_2_steps_as_1(_work_dir: Path) -> None:
    """The adapters drawn at TP 2 are TP 1's bit for bit; the first step moves every A and B as at TP 1 (within
    1e-5), clipped by the gradient norm too, and no base weight; given each other's slices, the ranks' step differs
    (the comparison sees a bad split)."""
    for family in ("llama", "llama-mqa", "neox"):
        step1 = first_step(lora_args(family, 1, 0))
        step2 = first_step(lora_args(family, 2, 0))
        for name, value in step1[0].items():
            check(torch.equal(step2[0][name], value), f"{family}: fresh {name} differs between TP 1 and 2")
        updates = [name for name, value in step1[2].items()
                   if ".lora." in name and not torch.equal(value, step1[1][name])]
        check(len(updates) == sum(".lora." in name for name in step1[2]), f"{family}: an adapter did not move")
        wrong = mismatches(step1, step2)
        check(not wrong, f"{family}: TP 2's step differs from TP 1's: {wrong[:3]}")
        swapped = mismatches(step1, first_step(lora_args(family, 2, 0), swap_slices=True))
        check(bool(swapped), f"{family}: adapters split the wrong way took TP 1's step")
        if family != "llama-mqa":  # DeepSpeed's norm counts a shared key/value head once per rank (architecture.md)
            clipping = dict(gradient_clipping=0.01, optimizer={"type": "SGD", "params": {"lr": 100.0}})  # a step of 1
            clipped = first_step(lora_args(family, 1, 0, **clipping))
            check(bool(mismatches(step1, clipped)), f"{family}: clipping at 0.01 left the step as it was")
            wrong = mismatches(clipped, first_step(lora_args(family, 2, 0, **clipping)))
            check(not wrong, f"{family}: the clipped step (by the whole adapters' norm) differs at TP 2: {wrong[:3]}")
        if dist.get_rank() == 0:
            report(case=f"{family} tp2", adapters=len(updates), swapped_split_caught=len(swapped),
                   largest_update_offset=max(update_offsets(step1, step2).values()))


def zero3_steps_and_saves_as_zero0(work_dir: Path) -> None:
    """2 data-parallel ranks: ZeRO-3 (adapters and base partitioned) moves the adapters as ZeRO-0 does; its tag
    holds the full adapters, equal to ZeRO-0's after the step, and a full resume or a weights-only load of it gives
    them back."""
    step0 = first_step(lora_args("llama", 1, 0))
    args = lora_args("llama", 1, 3, save=str(work_dir))
    engine, fresh = engine_of(args, random=True)
    partitioned = [name for name, param in engine.module.named_parameters()
                   if is_partitioned(param) and param.numel() == 0]
    check(len(partitioned) == sum(1 for _ in engine.module.parameters()), "a ZeRO-3 parameter is not partitioned")
    for name, value in step0[0].items():
        check(torch.equal(fresh[name], value), f"fresh {name} differs between ZeRO-0 and ZeRO-3")
    before = whole_weights(engine.module)
    tokens, labels = batch()
    engine.backward(causal_lm_loss(engine(tokens, parallel_output=True), labels, vocab_parallel=True))
    engine.step()
    after = whole_weights(engine.module)
    wrong = mismatches(step0, (fresh, before, after))
    check(not wrong, f"ZeRO-3's step differs from ZeRO-0's: {wrong[:3]}")

    tag = save_checkpoint(args, engine, iteration=1, consumed_train_samples=6)
    saved = read_module_weights(tag)
    adapters = [name for name in after if ".lora." in name]
    for name in adapters:
        check(saved[name].shape == after[name].shape and torch.allclose(saved[name], step0[2][name], rtol=0,
                                                                          atol=TOLERANCE),
              f"the ZeRO-3 tag's {name} is not the adapter ZeRO-0 trained")

    for finetune in (False, True):  # DeepSpeed's partitioned files, then the full module file alone
        load_args = lora_args("llama", 1, 3, load=str(work_dir), finetune=finetune)
        resumed, _ = engine_of(load_args)  # fresh adapters until the load
        load_checkpoint(resumed, plan_load(load_args, dist.get_world_size()))
        loaded = whole_weights(resumed.module)
        for name, value in after.items():
            check(torch.equal(loaded[name], value), f"{name} differs after loading the ZeRO-3 tag (finetune {finetune})")
    if dist.get_rank() == 0:
        report(case="zero3", adapters=len(adapters), partitioned=len(partitioned),
               largest_update_offset=max(update_offsets(step0, (fresh, before, after)).values()),
               saved_adapter_bytes=sum(saved[name].numel() * saved[name].element_size() for name in adapters))


def tensor_parallel_2_tag_resumes_at_1_under_zero3(work_dir: Path) -> None:
    """A LoRA tag saved at TP 2 (ZeRO-1) resumes fully, and loads weights-only, at TP 1 x DP 2 under ZeRO-3: the
    plan re-splits its adapters (and their optimizer state) by their layout, and every weight is the saved one."""
    adam = {"optimizer": {"type": "Adam", "params": {"lr": 0.01}}}
    args = lora_args("llama", 2, 1, save=str(work_dir), **adam)
    engine, _ = engine_of(args, random=True)
    tokens, labels = batch()
    engine.backward(causal_lm_loss(engine(tokens, parallel_output=True), labels, vocab_parallel=True))
    engine.step()
    saved = whole_weights(engine.module)
    save_checkpoint(args, engine, iteration=1, consumed_train_samples=6)
    for finetune in (False, True):
        load_args = lora_args("llama", 1, 3, load=str(work_dir), finetune=finetune, **adam)
        resumed, _ = engine_of(load_args)
        load_checkpoint(resumed, plan_load(load_args, dist.get_world_size()))
        loaded = whole_weights(resumed.module)
        for name, value in saved.items():
            check(torch.equal(loaded[name], value), f"{name} differs after loading the TP 2 tag at TP 1 under ZeRO-3 "
                                                    f"(finetune {finetune})")
    if dist.get_rank() == 0:
        report(case="tp2 -> tp1 zero3", tensors=len(saved))


# a Mixtral-like model, 4 experts (2 per rank at TP 2), 2 per token, its attention and experts adapted
EXPERTS = dict(moe_num_experts=4, moe_top_k=2, moe_intermediate_size=32,
               lora_target_modules=["q_proj", "experts.gate_up_proj", "experts.down_proj"])


def experts_split_over_2_ranks_step_as_1(work_dir: Path) -> None:
    """With the experts split over 2 tensor-parallel ranks (each its experts' adapters), the first step moves every
    A and B as at TP 1 and no base weight; given each other's experts' adapters, the ranks' step differs. The TP 2
    tag loads weights-only at TP 1 (2 data-parallel ranks) with every adapter whole and as trained."""
    step1 = first_step(lora_args("llama", 1, 0, **EXPERTS))
    args = lora_args("llama", 2, 0, save=str(work_dir), **EXPERTS)
    engine, fresh = engine_of(args, random=True)
    before = whole_weights(engine.module)
    tokens, labels = batch()
    engine.backward(causal_lm_loss(engine(tokens, parallel_output=True), labels, vocab_parallel=True))
    engine.step()
    step2 = (fresh, before, whole_weights(engine.module))
    experts = [name for name in step1[2] if ".experts.mlp.lora." in name]
    check(len(experts) == 8 and all(not torch.equal(step1[2][n], step1[1][n]) for n in experts),
          "the experts' adapters are not all there, or did not move")
    wrong = mismatches(step1, step2)
    check(not wrong, f"TP 2's step of the experts' adapters differs from TP 1's: {wrong[:3]}")
    swapped = mismatches(step1, first_step(lora_args("llama", 2, 0, **EXPERTS), swap_slices=True))
    check(any(".experts." in line for line in swapped), "the experts' adapters split the wrong way took TP 1's step")

    save_checkpoint(args, engine, iteration=1, consumed_train_samples=6)
    load_args = lora_args("llama", 1, 0, load=str(work_dir), finetune=True, **EXPERTS)
    loaded, _ = engine_of(load_args)
    load_checkpoint(loaded, plan_load(load_args, dist.get_world_size()))
    found = whole_weights(loaded.module)
    for name, value in step2[2].items():
        check(torch.equal(found[name], value), f"{name} differs after loading the TP 2 tag at TP 1")
    if dist.get_rank() == 0:
        report(case="experts tp2", expert_adapters=len(experts), swapped_split_caught=len(swapped),
               largest_update_offset=max(update_offsets(step1, step2).values()))


CHECKS = {"tp2": tensor_parallel_2_steps_as_1, "zero3": zero3_steps_and_saves_as_zero0,
          "reshard": tensor_parallel_2_tag_resumes_at_1_under_zero3, "experts": experts_split_over_2_ranks_step_as_1}


if __name__ == "__main__":
    run_named_check(CHECKS, {})
