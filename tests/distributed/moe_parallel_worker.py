"""One rank of the 2-rank mixture-of-experts tests; started by tests/distributed/test_moe_parallel.py.

    python -m torch.distributed.run --nproc_per_node 2 tests/distributed/moe_parallel_worker.py experts <work dir>

One start checks, with the experts split over the 2 tensor-parallel ranks (2 of 4 experts each): a Mixtral, a
Qwen3-MoE, a Qwen2-MoE (shared expert) and an OLMoE (q/k norms across heads, each rank its heads' slice) folder saved
by transformers take transformers' first step (loss, load-balancing loss, every
gradient joined over the ranks); a rank whose experts get no token takes the step of size 1; a run saved at TP 2
resumes in full at TP 1 (the 2 ranks data-parallel) with the losses of the run that never stopped, and back;
module-only loads across the split give the saved weights bit for bit. Any failed comparison raises.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron.checkpointing import load_checkpoint, plan_load, save_checkpoint  # noqa: E402
from megatron.data import BatchOptions  # noqa: E402
from megatron.model import build_model  # noqa: E402
from megatron.neox_arguments import NeoXArgs  # noqa: E402
from megatron.objectives import objective_for  # noqa: E402
from tests.distributed.tensor_parallel_worker import (  # noqa: E402
    BASE,
    FAMILIES,
    SEQ,
    VOCAB,
    check,
    full,
    hf_folder_engine_at_tp2,
    run_named_check,
    set_tensor_parallel_size,
    trained_engine,
)
from tests.worker_report import report  # noqa: E402

# a Llama with 4 experts in every layer, 2 per token, trained with transformers' load-balancing loss
EXPERTS = {**BASE, **FAMILIES["llama"], "moe_num_experts": 4, "moe_top_k": 2, "moe_router_type": "topk",
           "moe_intermediate_size": 32, "moe_load_balancing_loss": True, "moe_load_balancing_loss_coef": 0.02}
RUN = dict(train_micro_batch_size_per_gpu=3, gradient_accumulation_steps=1, train_iters=10, precision="fp32",
           optimizer={"type": "Adam", "params": {"lr": 1e-2}}, zero_optimization={"stage": 1},
           checkpoint_validation_with_forward_pass=True)


def hf_folder_at_tp2_takes_the_step_of_transformers(kind: str, work_dir: Path) -> None:
    from transformers.core_model_loading import revert_weight_conversion

    from megatron.hf.mapping import convert_tensors, hf_to_ours
    from tests.unit.test_hf_families import long_tokens

    model, spec, args, engine = hf_folder_engine_at_tp2(kind, work_dir)
    check(args.moe_load_balancing_loss, f"{kind}: the folder asks for the load-balancing loss")
    check(len(engine.module.sequential.get_submodule("2").mlp.experts.mlp.local) == 2, f"{kind}: not 2 experts on this rank")
    batch = long_tokens(seed=1)
    loss, metrics = objective_for(args, BatchOptions())(engine, {"text": batch})
    engine.backward(loss)
    grads = full({n: p.grad for n, p in engine.module.named_parameters()}, engine.module.arch)

    model.train()
    targets = batch[:, 1:].contiguous()  # the same inputs and targets (shift_labels: given unshifted)
    expected = model(input_ids=batch[:, :-1], labels=targets, shift_labels=targets)
    expected.loss.backward()
    hf_grads = revert_weight_conversion(model, {name: p.grad for name, p in model.named_parameters()})
    expected_grads = convert_tensors(hf_grads.items(), hf_to_ours(spec.family, spec.architecture()), "grads")
    balance = metrics["load_balancing_loss"].item()
    check(abs(balance - expected.aux_loss.item()) <= 1e-6 * expected.aux_loss.item(),
          f"{kind} at TP 2: load-balancing loss {balance}, transformers' {expected.aux_loss.item()}")
    check(abs(loss.item() - expected.loss.item()) <= 1e-6 * expected.loss.item(),
          f"{kind} at TP 2: loss {loss.item()}, transformers' {expected.loss.item()}")
    check(grads.keys() == expected_grads.keys(), f"{kind} at TP 2: other parameters than transformers'")
    for name, grad in expected_grads.items():
        check(torch.allclose(grads[name], grad, rtol=1e-4, atol=1e-6),
              f"{kind} at TP 2: gradient of {name} differs (max diff {(grads[name] - grad).abs().max()})")
    if dist.get_rank() == 0:
        report(case=f"{kind} folder at tp2", loss=loss.item(), load_balancing_loss=balance, gradients=len(grads))


def loss_and_grads_with_a_silent_router(tp: int) -> tuple[torch.Tensor, dict, set[int]]:
    """The loss and full gradients of the expert model whose routers score every expert alike, so that every
    token goes to the same 2 experts; and the experts chosen."""
    set_tensor_parallel_size(tp)
    args = NeoXArgs.from_dict({**EXPERTS, "model_parallel_size": tp, "num_gpus": dist.get_world_size()})
    model = build_model(args.architecture(), args.seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.router.layer.weight"):
                param.zero_()
    tokens = torch.randint(0, VOCAB, (3, SEQ + 1), generator=torch.Generator().manual_seed(5))
    routing = []
    loss, _ = objective_for(args, BatchOptions())(model.train(), {"text": tokens})
    model(tokens[:, :-1], routing=routing)
    loss.backward()
    chosen = {int(expert) for record in routing for expert in record.chosen.unique()}
    return loss.detach(), full({n: p.grad for n, p in model.named_parameters()}, model.arch), chosen


def a_rank_whose_experts_get_no_token_takes_the_step_of_size_1() -> None:
    """The ranks' collectives in the backward run also on a rank none of whose experts got a token."""
    loss2, grads2, chosen = loss_and_grads_with_a_silent_router(2)
    check(chosen in ({0, 1}, {2, 3}), f"the tokens went to experts {sorted(chosen)}, not to one rank's two")
    loss1, grads1, _ = loss_and_grads_with_a_silent_router(1)
    check(torch.allclose(loss1, loss2, rtol=1e-6), f"loss {loss2} at TP 2, {loss1} at TP 1")
    for name, grad in grads1.items():
        check(torch.allclose(grads2[name], grad, rtol=1e-4, atol=1e-6), f"gradient of {name} differs at TP 2")
    if dist.get_rank() == 0:
        report(case="a rank without tokens", experts_chosen=sorted(chosen))


def settings(tp: int, **values) -> NeoXArgs:
    return NeoXArgs.from_dict({**EXPERTS, **RUN, "model_parallel_size": tp, "num_gpus": dist.get_world_size(),
                               **{key: str(value) if isinstance(value, Path) else value for key, value in values.items()}})


def step(engine, args: NeoXArgs, batch_seed: int) -> float:
    """One step on the batch drawn from `batch_seed` (at TP 1 both data-parallel ranks take the same batch: the
    same step as TP 2's)."""
    tokens = torch.randint(0, VOCAB, (3, SEQ + 1), generator=torch.Generator().manual_seed(batch_seed))
    loss, _ = objective_for(args, BatchOptions())(engine, {"text": tokens})
    engine.backward(loss)
    engine.step()
    return loss.item()


def weights(engine) -> dict[str, torch.Tensor]:
    return full({n: p.detach().clone() for n, p in engine.module.named_parameters()}, engine.module.arch)


def loaded(args: NeoXArgs, seed: int, moved: str):
    """An engine (other weights than the checkpoint's until the load) loaded through the plan, whose block
    says how the experts moved."""
    engine = trained_engine(args, seed)
    plan = plan_load(args, dist.get_world_size() // args.model_parallel_size)
    check(moved in plan.describe(), f"the plan does not say '{moved}':\n{plan.describe()}")
    load_checkpoint(engine, plan)
    return engine


def close(got: float, expected: float, what: str) -> None:
    check(abs(got - expected) <= 1e-5 * abs(expected), f"{what}: loss {got}, the unbroken run's {expected}")


def checkpoints_move_experts_between_split_sizes(work_dir: Path) -> None:
    """TP 2 saves after 2 steps; a full resume at TP 1 takes steps 3 and 4 with the unbroken run's losses and saves
    after 3; a full resume of that at TP 2 takes step 4 with its loss again. Module-only loads across the split
    (each checks the stored logits) give the saved weights bit for bit."""
    at2, at1 = work_dir / "tp2", work_dir / "tp1"
    args = settings(2, save=at2)
    engine = trained_engine(args, args.seed)
    losses = [step(engine, args, batch) for batch in (1, 2)]
    save_checkpoint(args, engine, iteration=2, consumed_train_samples=6)
    saved_at2 = weights(engine)
    losses += [step(engine, args, batch) for batch in (3, 4)]
    unbroken = weights(engine)

    args = settings(1, load=at2, save=at1)
    engine = loaded(args, args.seed + 1, "experts 2 per rank -> 4")
    close(step(engine, args, 3), losses[2], "step 3 resumed at TP 1")
    save_checkpoint(args, engine, iteration=3, consumed_train_samples=12)
    saved_at1 = weights(engine)
    close(step(engine, args, 4), losses[3], "step 4 resumed at TP 1")

    args = settings(2, load=at1, save=work_dir / "tp2-again")
    engine = loaded(args, args.seed + 2, "experts 4 per rank -> 2")
    close(step(engine, args, 4), losses[3], "step 4 resumed at TP 2 from TP 1")
    after = weights(engine)
    for name, value in unbroken.items():
        check(torch.allclose(after[name], value, rtol=1e-5, atol=1e-6), f"{name} differs from the unbroken run's")

    for tp, source, saved, moved in ((1, at2, saved_at2, "experts 2 per rank -> 4"),
                                     (2, at1, saved_at1, "experts 4 per rank -> 2")):
        args = settings(tp, load=source, finetune=True)
        found = weights(loaded(args, args.seed + 3, moved))
        for name, value in saved.items():
            check(torch.equal(found[name], value), f"{name} differs after the module-only load at TP {tp}")
    if dist.get_rank() == 0:
        report(case="resume tp2 -> tp1 -> tp2", losses=losses)
        report(case="module-only across the split")


def experts_split_over_two_ranks(work_dir: Path) -> None:
    for kind in ("mixtral", "qwen3_moe", "qwen2_moe", "olmoe"):
        hf_folder_at_tp2_takes_the_step_of_transformers(kind, work_dir)
    a_rank_whose_experts_get_no_token_takes_the_step_of_size_1()
    checkpoints_move_experts_between_split_sizes(work_dir)


if __name__ == "__main__":
    run_named_check({"experts": experts_split_over_two_ranks}, {})
