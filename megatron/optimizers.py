"""Optimizer parameter groups: weight decay on weight matrices and embeddings, none on biases and norms."""

from __future__ import annotations

import torch

from megatron.model import no_weight_decay_param_names


def build_param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    exempt = no_weight_decay_param_names(model)
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for name, p in trainable if name not in exempt], "weight_decay": weight_decay}]
    no_decay = [p for name, p in trainable if name in exempt]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def replay_cpu_adam_step_count(engine) -> None:
    """After a resume on CPU, put DeepSpeed's Adam kernel where an unbroken run's would be.

    DeepSpeed's CPU Adam kernel (behind FusedAdam on a CPU accelerator) keeps beta^t for the bias
    correction in one object per process: an unbroken run multiplies it by beta at every step, a
    fresh process starts it from pow(beta, t), and the two differ in the last bits. Replaying
    steps 1..t with the same betas on a one-element tensor (learning rate 0) leaves the kernel
    exactly as an unbroken run left it, so the resumed run is bit-identical to one never stopped.
    """
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.adam import FusedAdam

    if get_accelerator().device_name() != "cpu":  # the GPU kernel derives beta^t from t at every step
        return
    optimizer = engine.optimizer
    while not isinstance(optimizer, FusedAdam):
        optimizer = getattr(optimizer, "optimizer", None)
        if optimizer is None:
            return
    steps = [int(state["step"]) for state in optimizer.state.values() if "step" in state]
    if not steps:
        return
    group = optimizer.param_groups[0]
    dummy = torch.zeros(1)
    dummy.grad = torch.zeros(1)
    replay = FusedAdam([dummy], lr=0.0, betas=group["betas"], eps=group["eps"],
                       adam_w_mode=bool(optimizer.adam_w_mode), weight_decay=0.0)
    for _ in range(max(steps)):
        replay.step()
