"""The optimizer's fp32 master weights: where each DeepSpeed optimizer keeps them, refresh, verify.

Why this exists: a module-only load writes the model's (16-bit) parameters, but the optimizer steps
its own fp32 master copy and then copies that back into the model. A master left at the random init
silently undoes the load at the first step. DeepSpeed's ``refresh_fp32_params`` copies the 16-bit
values, losing the low bits a full-precision checkpoint has, so the master is written here from the
checkpoint's own values.

Master layouts, detected by what the engine's optimizer holds (the same names and attributes in
every DeepSpeed release from 0.16.0 to 0.19.8; tools/compat/check_deepspeed_releases.sh checks them):

* no optimizer (ZeRO-3 without one holds a ``DeepSpeedZeRoOffload``), or a bare torch optimizer
  over the module's own parameters (fp32 without ZeRO): the parameters are the master.
* ``FP16_Optimizer`` (fp16 without ZeRO, fused Adam; bf16 too in 0.17.6 and later): ``fp16_groups`` + flat
  ``fp32_groups_flat``.
* ``FP16_UnfusedOptimizer``: ``fp16_groups`` + per-parameter ``fp32_groups``.
* ZeRO-1/2 (``DeepSpeedZeroOptimizer``) and ``BF16_Optimizer`` (bf16 with fp32 gradient accumulation,
  the default without ZeRO up to 0.17.0): each parameter's ``_hp_mapping``
  links the fragment of it this rank owns to its slice of the rank's fp32 partition.
* ZeRO-3 (``DeepSpeedZeroOptimizer_Stage3``): each parameter's local partition ``ds_tensor`` (and
  its whole copy while one exists) against its fp32 slice
  ``fp32_partitioned_groups_flat[g][offset:offset + n]`` at ``grad_position``.

Anything else raises CheckpointError: an unknown layout must not be skipped silently.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

from megatron.checkpointing.errors import CheckpointError
from megatron.model.zero3_partition import owned_range
from megatron.runtime.collective import reported_by_ranks


@dataclass
class MasterFragment:
    """The elements ``[start, start + n)`` of a flattened parameter: its master and its training copy."""

    name: str
    start: int
    master: torch.Tensor  # flat fp32 view into the optimizer's master storage (writable)
    trained: torch.Tensor  # flat view of the same elements in the training dtype


def master_layout(engine) -> str:
    """The name of the master-weight layout of ``engine``'s optimizer; raises CheckpointError if unknown."""
    optimizer = engine.optimizer
    if optimizer is None or isinstance(optimizer, DeepSpeedZeRoOffload):
        return "no-separate-master"
    if hasattr(optimizer, "fp32_partitioned_groups_flat") and hasattr(optimizer, "grad_position"):
        return "zero3-partitions"
    if _all_have_hp_mapping(_low_precision_groups(optimizer)):
        return "hp-mapping"
    if hasattr(optimizer, "fp16_groups") and hasattr(optimizer, "fp32_groups_flat"):
        return "flat-fp32-groups"
    if hasattr(optimizer, "fp16_groups") and hasattr(optimizer, "fp32_groups"):
        return "fp32-groups"
    if _optimizes_module_params_directly(engine):
        return "no-separate-master"
    raise CheckpointError(
        f"unknown optimizer {type(optimizer).__module__}.{type(optimizer).__name__}: cannot find its fp32 "
        "master weights, so a module-only load could not refresh them. Supported: DeepSpeed's "
        "FP16_Optimizer, FP16_UnfusedOptimizer, BF16_Optimizer, ZeRO stages 1-3, or a torch optimizer over "
        "the module's own parameters"
    )


def master_fragments(engine) -> Iterator[MasterFragment]:
    """This rank's master fragments, every trainable parameter the optimizer holds."""
    layout = master_layout(engine)
    if layout == "no-separate-master":
        return iter(())
    names = {id(param): name for name, param in engine.module.named_parameters()}
    return _FRAGMENTS_BY_LAYOUT[layout](engine.optimizer, names)


def refresh_master_weights(engine, full_precision: Mapping[str, torch.Tensor],
                           write_trained: Callable[[str], torch.Tensor | None] | None = None) -> None:
    """Write the master elements of every parameter named in ``full_precision`` from those values, then
    check every master element as verify_master_weights does, raising as it does.

    ``full_precision`` maps state-dict names to full (unpartitioned) tensors of any floating dtype;
    ``copy_`` converts element by element, so no fp32 temporary of a whole tensor is made. Writing and
    checking are one pass: each chunk of the master is checked while it is still in the CPU's cache,
    instead of being read from memory again (a load of 21M parameters: 22 against 26 ms).
    ``write_trained(name)`` runs for every name, in the order of ``full_precision``, each just before that
    parameter's master fragments are written, and all before the ranks' vote: a loader writes each
    parameter there. In a memory-mapped file's order, each copy reads pages the disk has just brought in
    while the rest comes, the parameters whose master another rank holds included, so that after the disk
    is done only the last parameters are left, not half of them after the vote (2 ranks, a cold 21M-parameter
    load: 3-4 ms). It copies ``full_precision[name]`` into the parameter and returns the tensor it copied into
    (None where the write is no plain copy, a ZeRO-3 partition). Where that tensor is the very memory the
    fragment maps and the source is in the training dtype, the copy itself put the source's bits there, so
    the check compares nothing for it (the address is the proof; see _count_differing).
    """
    _write_and_verify(engine, full_precision, write_trained)


def verify_master_weights(engine) -> None:
    """Every fp32 master element, cast to the training dtype, equals its training-dtype element.

    Checked on local partitions only (no gathers of weights); every rank learns which ranks found a
    mismatch, so every rank raises when any rank found one.
    """
    _write_and_verify(engine, {}, None)


def _write_and_verify(engine, full_precision: Mapping[str, torch.Tensor],
                      write_trained: Callable[[str], torch.Tensor | None] | None) -> None:
    first_mismatch = None
    mismatches = 0
    buffers: dict[tuple, torch.Tensor] = {}
    fragments = list(master_fragments(engine))
    fragments_of: dict[str, list[MasterFragment]] = {}
    for fragment in fragments:
        fragments_of.setdefault(fragment.name, []).append(fragment)
    with torch.no_grad():
        for name in [*full_precision, *(name for name in fragments_of if name not in full_precision)]:
            value = full_precision.get(name)
            copied_into = None if value is None or write_trained is None else write_trained(name)
            for fragment in fragments_of.get(name, ()):
                source = None if value is None else value.reshape(-1).narrow(0, fragment.start, fragment.master.numel())
                differing = _count_differing(fragment, buffers, source, copied_into)
                if differing and first_mismatch is None:
                    first_mismatch = (fragment.name, differing, fragment.master.numel())
                mismatches += differing
    _refuse_overlapping_masters(fragments)
    bad_ranks = [rank for rank, _ in reported_by_ranks(mismatches or None)]
    if not bad_ranks:
        return
    here = ""
    if first_mismatch is not None:
        name, differing, total = first_mismatch
        here = f"; on this rank first in '{name}' ({differing} of {total} local elements)"
    raise CheckpointError(
        f"the optimizer's fp32 master weights differ from the model's parameters on rank(s) {bad_ranks}{here}. "
        "The next optimizer step would copy the master over the model. Do not train from this state: after a "
        "module-only load it means the master refresh did not reach this optimizer's layout (a bug to report)"
    )


def _refuse_overlapping_masters(fragments: list[MasterFragment]) -> None:
    """Each fragment's master is checked right after it is written, so a later fragment whose master
    shares memory with an earlier fragment's master or parameter would change values already checked.
    No layout does that but ZeRO-3's, whose partition and whole copy of one parameter share one master,
    written twice with the same values; any other overlap means a layout misread here."""
    spans = sorted({(tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size(), is_master,
                     fragment.name, fragment.start)
                    for fragment in fragments for tensor, is_master in ((fragment.master, True), (fragment.trained, False))
                    if tensor.numel()})
    reach = {True: (0, ""), False: (0, "")}  # masters' and parameters' furthest end so far, and whose it is
    for start, end, is_master, name, _ in spans:  # a span overlaps an earlier one iff it starts before its end
        kinds = (True, False) if is_master else (True,)
        clash = next((reach[kind][1] for kind in kinds if start < reach[kind][0]), None)
        if clash is not None:
            raise CheckpointError(
                f"the fp32 master of '{name if is_master else clash}' shares memory with "
                f"'{clash if is_master else name}' in this optimizer's layout as read here, so a module-only load "
                "cannot write and check it (a bug to report)")
        reach[is_master] = max(reach[is_master], (end, name))


# Elements written, cast and compared at a time: a reused buffer this size stays in the CPU's cache, where
# a cast of a whole tensor would allocate (and page in) a fresh temporary as large as the tensor.
_VERIFY_CHUNK = 1 << 20
_WORD = 8  # bytes compared at a time: torch.equal on 64-bit integers is ~3x faster than on 16-bit ones


def _count_differing(fragment: MasterFragment, buffers: dict[tuple, torch.Tensor],
                     source: torch.Tensor | None = None, copied_into: torch.Tensor | None = None) -> int:
    """Elements of ``fragment`` whose master, cast to the training dtype, differs from the trained value;
    with ``source`` (the fragment's elements of the checkpoint) each chunk of the master is written from
    it first.

    A source in the training dtype written into an fp32 master is held exactly (fp32 holds every bf16 and
    fp16 value), so the master cast back is the source itself: the source is compared, without the cast.
    Where the trained elements are those of ``copied_into``, the tensor the whole source value was just
    copied into in the same dtype, they are the source's bits by that copy: nothing is compared. Comparing
    would read 2 bytes of each parameter twice more (a cold 21M-parameter load: 6 of 46 ms) to learn what
    the addresses already prove, and unlike a comparison it cannot be fooled by a parameter that held the
    checkpoint's values before a write that went elsewhere.
    """
    trained = fragment.trained
    exact_source = (source is not None and source.dtype == trained.dtype
                    and fragment.master.dtype == torch.float32 and trained.dtype in (torch.bfloat16, torch.float16))
    if exact_source and _is_part_of(trained, copied_into, fragment.start):
        fragment.master.copy_(source)
        return 0
    key = (trained.dtype, trained.device)
    if key not in buffers:
        buffers[key] = torch.empty(_VERIFY_CHUNK + _WORD, dtype=trained.dtype, device=trained.device)
    # The cast lands at the same offset modulo a word as the trained values, so both compare word by word.
    phase = trained.storage_offset() % (_WORD // trained.element_size())
    buffer, total, differing = buffers[key].narrow(0, phase, _VERIFY_CHUNK), fragment.master.numel(), 0
    for start in range(0, total, _VERIFY_CHUNK):
        length = min(_VERIFY_CHUNK, total - start)
        master = fragment.master.narrow(0, start, length)
        if source is not None:
            master.copy_(source.narrow(0, start, length))
        cast = source.narrow(0, start, length) if exact_source else buffer.narrow(0, 0, length).copy_(master)
        expected = trained.narrow(0, start, length)
        if not _same_bits(cast, expected):  # the common case needs no count
            differing += int((_bits(cast) != _bits(expected)).sum())
    return differing


def _is_part_of(trained: torch.Tensor, whole: torch.Tensor | None, start: int) -> bool:
    """Whether ``trained`` is the elements ``[start, start + trained.numel())`` of the contiguous ``whole``, by
    address: the same memory, not equal values."""
    return (whole is not None and (whole.dtype, whole.device) == (trained.dtype, trained.device)
            and whole.is_contiguous() and trained.is_contiguous()
            and start + trained.numel() <= whole.numel()
            and trained.data_ptr() == whole.data_ptr() + start * whole.element_size())


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous 1-D tensors of one dtype hold the same bytes: a word at a time where both
    are aligned alike (the buffers of _count_differing are), element by element otherwise."""
    a_bytes, b_bytes = a.view(torch.uint8), b.view(torch.uint8)
    size = a_bytes.numel()
    head = -a_bytes.storage_offset() % _WORD
    if head != -b_bytes.storage_offset() % _WORD or size < head + _WORD:  # no whole word to compare
        return torch.equal(_bits(a), _bits(b))
    end = head + (size - head) // _WORD * _WORD
    return (torch.equal(a_bytes[:head], b_bytes[:head])
            and torch.equal(a_bytes[head:end].view(torch.int64), b_bytes[head:end].view(torch.int64))
            and torch.equal(a_bytes[end:], b_bytes[end:]))


def _optimizes_module_params_directly(engine) -> bool:
    module_params = {id(param) for param in engine.module.parameters()}
    groups = getattr(engine.optimizer, "param_groups", None)
    if not groups:
        return False
    return all(id(param) in module_params for group in groups for param in group["params"])


def _low_precision_groups(optimizer) -> list[list[torch.nn.Parameter]] | None:
    for attribute in ("bit16_groups", "bf16_groups"):
        groups = getattr(optimizer, attribute, None)
        if groups is not None:
            return groups
    return None


def _all_have_hp_mapping(groups) -> bool:
    if groups is None:
        return False
    params = [param for group in groups for param in group]
    return bool(params) and all(hasattr(param, "_hp_mapping") for param in params)


def _name_of(param, names: dict[int, str]) -> str:
    try:
        return names[id(param)]
    except KeyError:
        raise CheckpointError(
            f"the optimizer holds a parameter of shape {tuple(param.shape)} that is not a parameter of the "
            "engine's module; cannot tell which checkpoint tensor its master weights belong to"
        ) from None


def _hp_mapping_fragments(optimizer, names) -> Iterator[MasterFragment]:
    for group in _low_precision_groups(optimizer):
        for param in group:
            mapping = param._hp_mapping
            if mapping is None:  # this rank owns no element of the parameter
                continue
            address = mapping.lp_fragment_address
            yield MasterFragment(
                name=_name_of(param, names),
                start=address.start,
                master=mapping.hp_fragment.view(-1),
                trained=param.data.view(-1).narrow(0, address.start, address.numel),
            )


def _flat_fp32_group_fragments(optimizer, names) -> Iterator[MasterFragment]:
    for params, flat_master in zip(optimizer.fp16_groups, optimizer.fp32_groups_flat, strict=True):
        total = sum(param.numel() for param in params)
        if total != flat_master.numel():
            raise CheckpointError(
                f"{type(optimizer).__name__}: a flat fp32 master group holds {flat_master.numel()} elements "
                f"but its parameters {total}; unknown layout, cannot refresh the master weights"
            )
        offset = 0
        for param in params:
            yield MasterFragment(
                name=_name_of(param, names),
                start=0,
                master=flat_master.data.narrow(0, offset, param.numel()),
                trained=param.data.view(-1),
            )
            offset += param.numel()


def _fp32_group_fragments(optimizer, names) -> Iterator[MasterFragment]:
    for params, masters in zip(optimizer.fp16_groups, optimizer.fp32_groups, strict=True):
        for param, master in zip(params, masters, strict=True):
            yield MasterFragment(
                name=_name_of(param, names), start=0, master=master.data.view(-1), trained=param.data.view(-1)
            )


def _zero3_fragments(optimizer, names) -> Iterator[MasterFragment]:
    for params in optimizer.fp16_groups:
        for param in params:
            group_index, offset, numel = optimizer.grad_position[optimizer.get_param_id(param)]
            swappable = getattr(optimizer, "_swappable_optimizer_subgroup", lambda _: False)
            if swappable(group_index):
                raise CheckpointError(
                    "ZeRO-3 optimizer states swapped to NVMe: module-only loads cannot reach the fp32 master "
                    "weights there; disable offload_optimizer to nvme for the load"
                )
            partition_rank = dist.get_rank(
                group=getattr(param, "ds_process_group", optimizer.dp_process_group)
            )
            start, owned = owned_range(partition_rank, numel, param.ds_numel)
            master = optimizer.fp32_partitioned_groups_flat[group_index].data.narrow(0, offset, numel)
            name = _name_of(param, names)
            partition = param.ds_tensor.data.view(-1).narrow(0, 0, owned)
            yield MasterFragment(name=name, start=start, master=master.narrow(0, 0, owned), trained=partition)
            if param.ds_status == ZeroParamStatus.AVAILABLE and param.data.numel() == param.ds_numel:
                # A whole copy next to the partition (a "persistent" parameter after a step): the
                # forward pass reads this one, so it must match the master too.
                whole = param.data.view(-1).narrow(0, start, owned)
                yield MasterFragment(name=name, start=start, master=master.narrow(0, 0, owned), trained=whole)


_FRAGMENTS_BY_LAYOUT = {
    "zero3-partitions": _zero3_fragments,
    "hp-mapping": _hp_mapping_fragments,
    "flat-fp32-groups": _flat_fp32_group_fragments,
    "fp32-groups": _fp32_group_fragments,
}


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bits, so equality is exact (NaN equals an identical NaN, -0.0 differs from 0.0)."""
    integer = {2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
    return tensor.contiguous().view(integer)
