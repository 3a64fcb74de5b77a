"""The command that starts every rank: DeepSpeed's launcher, with our launcher settings as its flags.

Pure functions of the settings, so the exact command is testable without starting anything.
"""

from __future__ import annotations

import sys

from megatron.neox_arguments import NeoXArgs


def runner_arguments(args: NeoXArgs, user_script: str, user_args: list[str], *, cpu_only: bool) -> list[str]:
    """argv for `deepspeed` (deepspeed.launcher.runner) that starts exactly `args.global_num_gpus` ranks.

    With no num_gpus and no hostfile, a CPU-only machine runs one rank: DeepSpeed itself would
    start one per NUMA node, which is not what the settings (and the batch arithmetic) assumed.
    """
    flags: list[str] = []
    if args.hostfile:
        flags += ["--hostfile", args.hostfile]
    if args.include:
        flags += ["--include", args.include]
    if args.exclude:
        flags += ["--exclude", args.exclude]
    if args.num_nodes is not None and args.num_nodes != -1:
        flags += ["--num_nodes", str(args.num_nodes)]
    if args.num_gpus is not None:
        flags += ["--num_gpus", str(args.num_gpus)]
    elif cpu_only and not (args.hostfile or args.include or args.exclude):
        flags += ["--num_gpus", "1"]
    flags += ["--master_port", str(args.master_port)]
    if args.master_addr:
        flags += ["--master_addr", args.master_addr]
    if args.deepspeed_slurm or args.deepspeed_mpi:
        flags += ["--force_multi"]  # as GPT-NeoX's deepy: the multi-node runner (srun/mpirun) starts the ranks
    flags += ["--launcher", args.launcher, "--log_level", "warning"]
    return [*flags, user_script, *user_args]


def launcher_environment(environ: dict[str, str], *, cpu_only: bool) -> dict[str, str]:
    """The environment the ranks start with. On a CPU-only machine DeepSpeed is told its accelerator
    up front; otherwise every process it starts warns that it fell back to the CPU."""
    if cpu_only and "DS_ACCELERATOR" not in environ:
        return {**environ, "DS_ACCELERATOR": "cpu"}
    return dict(environ)


def launch_command(args: NeoXArgs, user_script: str, user_args: list[str], *, cpu_only: bool,
                   python: str = sys.executable) -> list[str]:
    """The full command line: DeepSpeed's launcher run by this Python (same environment as deepy)."""
    return [python, "-m", "deepspeed.launcher.runner",
            *runner_arguments(args, user_script, user_args, cpu_only=cpu_only)]
