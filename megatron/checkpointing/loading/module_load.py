"""Load module weights into a DeepSpeed engine without touching optimizer files (the module-only path).

Does not use DeepSpeed's own ``load_module_only`` branch: it differs by release and, under ZeRO-3,
rebuilds the weights from optimizer shards of the ``latest`` tag.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.loading import master_weights
from megatron.model.zero3_partition import is_partitioned, write_whole_value

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

    @property
    def complete(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched)

    def describe(self) -> str:
        """Every key that did not load, one line per kind (the non-strict part of the load plan)."""
        lines = [f"checkpoint weights: {len(self.loaded)} tensors loaded, load_module_strict is false"]
        if self.missing:
            lines.append(f"  not in the checkpoint, left as initialised ({len(self.missing)}): {', '.join(self.missing)}")
        if self.mismatched:
            shown = ", ".join(f"{name} (checkpoint {list(ckpt)}, model {list(model)})" for name, ckpt, model in self.mismatched)
            lines.append(f"  other shape in the checkpoint, left as initialised ({len(self.mismatched)}): {shown}")
        if self.unexpected:
            lines.append(f"  in the checkpoint, not in the model, ignored ({len(self.unexpected)}): {', '.join(self.unexpected)}")
        return "\n".join(lines)


def compare_module_keys(targets: Mapping[str, torch.Tensor], state_dict: Mapping[str, torch.Tensor]) -> ModuleLoadReport:
    """Which model keys the checkpoint lacks, which it has in another shape, which it has that the model does not."""
    report = ModuleLoadReport()
    report.missing = [name for name in targets if name not in state_dict]
    report.unexpected = [name for name in state_dict if name not in targets]
    for name, target in targets.items():
        if name in state_dict:
            model_shape, ckpt_shape = _full_shape(target), tuple(state_dict[name].shape)
            if model_shape != ckpt_shape:
                report.mismatched.append((name, ckpt_shape, model_shape))
    return report


def check_random_layers(report: ModuleLoadReport, targets: Iterable[str], allow_random: Iterable[str]) -> None:
    """A non-strict load may leave single tensors as initialised, but not a whole layer (every tensor of
    a Linear, norm or embedding), unless each of its tensors matches a `load_module_allow_random` pattern."""
    not_loaded = set(report.missing) | {name for name, _, _ in report.mismatched}
    layers: dict[str, list[str]] = {}
    for name in targets:
        layers.setdefault(name.rpartition(".")[0], []).append(name)
    patterns = list(allow_random)
    refused = [layer for layer, names in layers.items()
               if all(name in not_loaded for name in names)
               and not all(any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns) for name in names)]
    if refused:
        shown = ", ".join(refused[:_SHOWN_KEYS]) + (f" and {len(refused) - _SHOWN_KEYS} more" if len(refused) > _SHOWN_KEYS else "")
        raise CheckpointError(
            f"the checkpoint has no weights for {len(refused)} whole layer(s) of the model ({shown}), which would "
            "train from their random initialisation. Check the model settings against the checkpoint, or, if "
            "that is meant, list them in `load_module_allow_random` (glob patterns over parameter names, e.g. "
            f"'{refused[0]}.*')"
        )


def load_module_only(engine, state_dict: dict[str, torch.Tensor], strict: bool = True,
                     allow_random: Iterable[str] = (), keep_initialised: tuple[str, ...] = ()) -> ModuleLoadReport:
    """Load ``state_dict`` into ``engine.module``, refresh the fp32 master weights from it and verify them.

    ``state_dict`` holds full (unpartitioned) tensors with the module's ``state_dict()`` names. Every
    rank passes the same dict; under ZeRO-3 each rank keeps only its own partition. The master gets
    the checkpoint's values as they are (``copy_`` converts element by element to fp32, no temporary),
    the model their cast to its dtype, so a checkpoint with more precision than the training dtype
    keeps it in the master. A non-strict load
    refuses to leave a whole layer random unless `allow_random` patterns name it (check_random_layers).
    Parameters whose names end with one of `keep_initialised` are left as initialised, by design (a reward
    model's fresh head), and not looked for in the checkpoint.
    """
    targets = {name: value for name, value in engine.module.state_dict(keep_vars=True).items()
               if not (keep_initialised and name.endswith(keep_initialised))}
    report = compare_module_keys(targets, state_dict)
    report.master_layout = master_weights.master_layout(engine)
    if strict:
        _raise_on_architecture_mismatch(report)
    else:
        check_random_layers(report, targets, allow_random)

    mismatched = {name for name, _, _ in report.mismatched}
    report.loaded = [name for name in targets if name in state_dict and name not in mismatched]
    loaded = set(report.loaded)

    def write(name: str) -> torch.Tensor | None:  # copy_ casts element by element: no fp32 temporary of the tensor
        target = targets[name]
        with torch.no_grad():
            _write(target, state_dict[name])
        return None if is_partitioned(target) else target

    # writes every loaded tensor in the checkpoint's order (a memory-mapped file's), each parameter just before its
    # master, every master element it can, and checks all of them
    master_weights.refresh_master_weights(engine, {name: value for name, value in state_dict.items() if name in loaded},
                                          write)
    return report


def _full_shape(target: torch.Tensor) -> tuple[int, ...]:
    return tuple(target.ds_shape) if is_partitioned(target) else tuple(target.shape)


def _write(target: torch.Tensor, value: torch.Tensor) -> None:
    if is_partitioned(target):
        write_whole_value(target, value)
    else:
        target.data.copy_(value)


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
