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
    """After a resume, put DeepSpeed's CPU Adam kernel where an unbroken run's would be.

    DeepSpeed's CPU Adam kernel keeps beta^t for the bias correction in a C++ object that lives as
    long as the process: an unbroken run multiplies it by beta at every step, a fresh process starts
    it from pow(beta, t), and the two differ in the last bits. Replaying steps 1..t with the same betas
    on a one-element tensor (learning rate 0) through the same C++ object leaves it exactly as an
    unbroken run left it, so the resumed run is bit-identical to one never stopped.

    Two optimizers use that kernel: DeepSpeedCPUAdam (ZeRO-Offload's ``offload_optimizer: {device:
    cpu}``, on any accelerator), whose object is its own (``opt_id``), and FusedAdam on a CPU
    accelerator, whose object is one per process and Adam/AdamW mode. FusedAdam on a GPU derives
    beta^t from t at every step and needs nothing.
    """
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    optimizer = engine.optimizer
    while not isinstance(optimizer, (DeepSpeedCPUAdam, FusedAdam)):
        optimizer = getattr(optimizer, "optimizer", None)
        if optimizer is None:
            return
    if isinstance(optimizer, FusedAdam) and get_accelerator().device_name() != "cpu":
        return
    steps = [int(state["step"]) for state in optimizer.state.values() if "step" in state]
    if not steps:
        return
    group = optimizer.param_groups[0]
    if isinstance(optimizer, DeepSpeedCPUAdam):
        beta1, beta2 = group["betas"]
        param, grad, exp_avg, exp_avg_sq = (torch.zeros(1) for _ in range(4))
        for step in range(1, max(steps) + 1):
            optimizer.ds_opt_adam.adam_update(optimizer.opt_id, step, 0.0, beta1, beta2, group["eps"], 0.0,
                                              group["bias_correction"], param, grad, exp_avg, exp_avg_sq)
        return
    dummy = torch.zeros(1)
    dummy.grad = torch.zeros(1)
    replay = FusedAdam([dummy], lr=0.0, betas=group["betas"], eps=group["eps"],
                       adam_w_mode=bool(optimizer.adam_w_mode), weight_decay=0.0)
    for _ in range(max(steps)):
        replay.step()
