"""Load module weights into a DeepSpeed engine without touching optimizer files (the module-only path).

Does not use DeepSpeed's own ``load_module_only`` branch: it differs by release and, under ZeRO-3,
rebuilds the weights from optimizer shards of the ``latest`` tag.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

from megatron.checkpointing import master_weights
from megatron.checkpointing.errors import CheckpointError

_SHOWN_KEYS = 5


@dataclass
class ModuleLoadReport:
    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # in the model, not in the checkpoint
    unexpected: list[str] = field(default_factory=list)  # in the checkpoint, not in the model
    mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(
        default_factory=list
    )  # name, ckpt, model
    master_layout: str = ""


def load_module_only(engine, state_dict: dict[str, torch.Tensor], strict: bool = True) -> ModuleLoadReport:
    """Load ``state_dict`` into ``engine.module``, refresh the fp32 master weights from it, verify them.

    ``state_dict`` holds full (unpartitioned) tensors with the module's ``state_dict()`` names. Every
    rank passes the same dict; under ZeRO-3 each rank keeps only its own partition. Floating values
    are taken in fp32: the master gets them as they are, the model their cast to its dtype, so a
    checkpoint with more precision than the training dtype keeps it in the master.
    """
    targets = engine.module.state_dict(keep_vars=True)
    report = ModuleLoadReport(master_layout=master_weights.master_layout(engine))
    report.missing = [name for name in targets if name not in state_dict]
    report.unexpected = [name for name in state_dict if name not in targets]
    for name, target in targets.items():
        if name in state_dict:
            model_shape, ckpt_shape = _full_shape(target), tuple(state_dict[name].shape)
            if model_shape != ckpt_shape:
                report.mismatched.append((name, ckpt_shape, model_shape))
    if strict:
        _raise_on_architecture_mismatch(report)

    mismatched = {name for name, _, _ in report.mismatched}
    report.loaded = [name for name in targets if name in state_dict and name not in mismatched]
    with torch.no_grad():
        for name in report.loaded:  # copy_ casts element by element: no fp32 temporary of the tensor
            _write(targets[name], state_dict[name])
    master_weights.refresh_master_weights(engine, _Float32View(state_dict, report.loaded))
    master_weights.verify_master_weights(engine)
    return report


def _full_shape(target: torch.Tensor) -> tuple[int, ...]:
    return tuple(target.ds_shape) if hasattr(target, "ds_shape") else tuple(target.shape)


class _Float32View(Mapping):
    """The selected entries of a state dict, floating ones in fp32, converted one at a time on access.

    Converting lazily keeps the peak memory at one fp32 tensor instead of a whole fp32 model per rank.
    """

    def __init__(self, state_dict: Mapping[str, torch.Tensor], names: list[str]):
        self._state_dict = state_dict
        self._names = set(names)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        value = self._state_dict[name]
        return value.to(torch.float32) if value.is_floating_point() else value

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def _write(target: torch.Tensor, value: torch.Tensor) -> None:
    if hasattr(target, "ds_id"):
        _write_zero3_param(target, value)
    else:
        target.data.copy_(value)


def _write_zero3_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Write this rank's partition (the last rank's may end in padding, left as it is).

    A parameter that is currently whole on every rank (ZeRO-3 keeps small ones "persistent") also
    gets its full copy written, or the forward pass would keep using the old values.
    """
    partition = param.ds_tensor.data.view(-1)
    size = partition.numel()
    start = dist.get_rank(group=getattr(param, "ds_process_group", None)) * size
    owned = max(0, min(size, param.ds_numel - start))
    partition.narrow(0, 0, owned).copy_(value.reshape(-1).narrow(0, start, owned))
    if param.ds_status == ZeroParamStatus.AVAILABLE:
        param.data.copy_(value.view(param.ds_shape))


def _raise_on_architecture_mismatch(report: ModuleLoadReport) -> None:
    problems = []
    if report.missing:
        problems.append(
            f"{len(report.missing)} model keys missing from the checkpoint: {report.missing[:_SHOWN_KEYS]}"
        )
    if report.unexpected:
        problems.append(
            f"{len(report.unexpected)} checkpoint keys the model does not have: {report.unexpected[:_SHOWN_KEYS]}"
        )
    if report.mismatched:
        shown = [
            f"{name}: checkpoint {ckpt} vs model {model}"
            for name, ckpt, model in report.mismatched[:_SHOWN_KEYS]
        ]
        problems.append(f"{len(report.mismatched)} shape mismatches: {shown}")
    if problems:
        raise CheckpointError(
            "the checkpoint does not match the model architecture: "
            + "; ".join(problems)
            + ". Check the model settings against the checkpoint's saved args, or load non-strictly on purpose"
        )
