"""How many ranks a run gets, counted exactly as DeepSpeed's launcher will pick them.

The launcher settings mean what they mean to `deepspeed`: a hostfile (`host slots=N` lines)
defines the pool, include/exclude filter it, num_nodes/num_gpus trim it to the first hosts and
slots. Without a hostfile the pool is this machine. Without a GPU, num_gpus counts CPU ranks.
"""

from __future__ import annotations

import os
from pathlib import Path

from megatron.neox_arguments.errors import ConfigError

DEEPSPEED_DEFAULT_HOSTFILE = "/job/hostfile"  # deepspeed.launcher.constants.DLTS_HOSTFILE


def accelerator_is_cpu() -> bool:
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name() == "cpu"


def check_precision_on_cpu(args) -> None:
    """DeepSpeed's CPU accelerator refuses fp16 inside every rank; say so before any rank starts."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if args.precision != "fp16" or accelerator.device_name() != "cpu" or accelerator.is_fp16_supported():
        return
    set_by = [f"{args.source_of(name)}: {name}" for name in ("precision", "fp16") if args.set_by_user(name)]
    raise ConfigError(
        f"{' and '.join(set_by) or 'precision'}: fp16 is not supported by DeepSpeed on a CPU (this machine has "
        "no GPU); use bf16 or fp32 here, fp16 on a GPU machine"
    )


def visible_device_ids() -> list[str]:
    """The GPUs the accelerator's visibility variable (CUDA_VISIBLE_DEVICES) names, as written (ids or UUIDs);
    none on a CPU or when it is unset."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu":
        return []
    visible = os.environ.get(accelerator.visible_devices_envs()[0], "")
    return [device.strip() for device in visible.split(",") if device.strip()]


def default_local_ranks() -> int:
    """Ranks on this machine when num_gpus is unset: every visible GPU, or 1 CPU rank."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu":
        return 1
    return len(visible_device_ids()) or accelerator.device_count()


def effective_hostfile(hostfile: str | None) -> str | None:
    """The hostfile DeepSpeed will read: the one given (it must exist), else its default if present."""
    if hostfile is not None:
        if not Path(hostfile).is_file():
            raise ConfigError(f"hostfile: {hostfile!r} does not exist; fix the path or remove the setting")
        return hostfile
    return DEEPSPEED_DEFAULT_HOSTFILE if Path(DEEPSPEED_DEFAULT_HOSTFILE).is_file() else None


def read_hostfile(path: str) -> dict[str, int]:
    from deepspeed.launcher.runner import fetch_hostfile

    try:
        return dict(fetch_hostfile(path))
    except ValueError as err:
        raise ConfigError(f"hostfile {path!r}: {err} (each line: `hostname slots=N`)") from None


def active_hosts(
    num_gpus: int | None,
    num_nodes: int | None,
    hostfile: str | None,
    include: str | None,
    exclude: str | None,
) -> list[tuple[str, list[int]]]:
    """(host, slots) of every node that gets ranks, in the order DeepSpeed numbers the nodes (node_rank)."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.launcher.runner import parse_inclusion_exclusion

    if include and exclude:
        raise ConfigError("include and exclude: DeepSpeed accepts only one of them; remove the other")
    if (include or exclude) and (num_gpus is not None or num_nodes is not None):
        raise ConfigError(
            "include/exclude cannot be combined with num_gpus/num_nodes (DeepSpeed refuses it); keep one way"
        )
    hostfile = effective_hostfile(hostfile)
    if hostfile is not None:
        pool = read_hostfile(hostfile)
    else:
        if num_nodes is not None and num_nodes > 1:
            raise ConfigError(f"num_nodes: {num_nodes} nodes need a hostfile listing them; set hostfile")
        local = get_accelerator().device_count() if (include or exclude) else (num_gpus or default_local_ranks())
        pool = {"localhost": local}
    try:
        active = parse_inclusion_exclusion(pool, include or "", exclude or "")
    except ValueError as err:
        key = "include" if include else "exclude"
        raise ConfigError(f"{key}: {err}") from None
    hosts = list(active.items())
    if num_nodes is not None and num_nodes > 0:
        hosts = hosts[:num_nodes]
    if num_gpus is not None and num_gpus > 0:
        hosts = [(host, list(range(num_gpus))) for host, _ in hosts]
    if not any(slots for _, slots in hosts):
        raise ConfigError("the launcher settings (hostfile/include/exclude/num_gpus/num_nodes) leave no rank to run on")
    return hosts
