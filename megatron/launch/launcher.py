"""How deepy.py starts the ranks: this machine's ranks directly, or DeepSpeed's runner for other machines.

When every rank this deepy.py starts runs on this machine (the whole job, or this node's part of a job
started node by node), deepy.py starts them itself, each with the command line and environment
DeepSpeed's per-node launcher (deepspeed.launcher.launch) gives a rank: the world DeepSpeed's runner
would hand that launcher, the rank variables, the accelerator's visible devices. Going through
DeepSpeed's runner and launcher would only add two interpreters that import torch, and a launcher that
polls its ranks once a second. With ranks on other machines it is DeepSpeed's runner, which starts them
its own way. Pure functions of the settings, so the exact commands are testable without starting anything.
"""

from __future__ import annotations

import contextlib
import io
import os
import random
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from megatron.neox_arguments import ConfigError, NeoXArgs
from megatron.neox_arguments.world import active_hosts, effective_hostfile, visible_device_ids

PACKAGE_PARENT = str(Path(__file__).resolve().parents[2])  # the folder holding megatron/

# DeepSpeed's runner logs the full rank command (our settings blob) with a failing rank's exit
# code at level ERROR; the rank has already said what went wrong in one line.
LAUNCHER_LOG_LEVEL = "critical"


def runner_arguments(args: NeoXArgs, user_script: str, user_args: list[str], *, cpu_only: bool,
                     runner_takes_log_level: bool = True) -> list[str]:
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
    flags += ["--launcher", args.launcher]
    if runner_takes_log_level:
        flags += ["--log_level", LAUNCHER_LOG_LEVEL]
    return [*flags, user_script, *user_args]


def launcher_environment(environ: dict[str, str], *, cpu_only: bool) -> dict[str, str]:
    """The environment the ranks (or DeepSpeed's runner) start with: this package first on PYTHONPATH, so that
    a train script anywhere imports it. On a CPU-only machine DeepSpeed is told its accelerator up
    front; otherwise every process it starts warns that it fell back to the CPU."""
    path = [PACKAGE_PARENT, *(part for part in environ.get("PYTHONPATH", "").split(os.pathsep) if part)]
    environment = {**environ, "PYTHONPATH": os.pathsep.join(path)}
    if cpu_only and "DS_ACCELERATOR" not in environ:
        environment["DS_ACCELERATOR"] = "cpu"
    return environment


def runner_accepts_log_level() -> bool:
    """Whether the installed DeepSpeed runner has --log_level, asked of its parser. Releases before 0.18 lack it."""
    from deepspeed.launcher import runner

    with contextlib.redirect_stderr(io.StringIO()):
        try:
            runner.parse_args(["--log_level", LAUNCHER_LOG_LEVEL, "train.py"])
        except SystemExit:
            return False
    return True


# DeepSpeed's multi-node runner class per `launcher` (deepspeed.launcher.multinode_runner, 0.16 on).
MULTI_NODE_RUNNERS = {"pdsh": "PDSHRunner", "openmpi": "OpenMPIRunner", "mvapich": "MVAPICHRunner",
                      "slurm": "SlurmRunner", "mpich": "MPICHRunner", "impi": "IMPIRunner"}


def check_multi_node_runner(args: NeoXArgs, runner_argv: list[str]) -> None:
    """What DeepSpeed's multi-node runner refuses (the MPI ones take every slot of every host: no include,
    exclude, num_nodes or num_gpus) it refuses only once the launch has begun, with a traceback; its own
    check, asked here, stops deepy.py with one line instead."""
    from deepspeed.launcher import multinode_runner, runner

    parsed = runner.parse_args(runner_argv)
    runner_class = getattr(multinode_runner, MULTI_NODE_RUNNERS[args.launcher])
    try:
        if runner_class is multinode_runner.PDSHRunner:
            runner_class(parsed, "")
        else:
            runner_class(parsed, "", {})
    except ValueError as err:
        raise ConfigError(f"{args.source_of('launcher')}: launcher: {args.launcher}: DeepSpeed says: {err}; remove "
                          "include/exclude/num_nodes/num_gpus (the hostfile's slots decide) or use pdsh or slurm") from None


def runs_on_one_machine(args: NeoXArgs) -> bool:
    """The whole job runs on this machine."""
    return effective_hostfile(args.hostfile) is None and not (args.deepspeed_slurm or args.deepspeed_mpi)


def starts_only_local_ranks(args: NeoXArgs) -> bool:
    """Every rank this deepy.py starts runs on this machine: the whole job, or this node's part of it
    (node_rank: each node's deepy.py starts its own ranks)."""
    return runs_on_one_machine(args) or args.node_rank is not None


def node_hosts(args: NeoXArgs) -> dict[str, list]:
    """Every node of the job and the devices its ranks use, in node_rank order: what DeepSpeed's runner
    hands its per-node launcher (the settings counted the ranks from the same resolution)."""
    num_nodes = None if args.num_nodes == -1 else args.num_nodes
    hosts = dict(active_hosts(args.num_gpus, num_nodes, args.hostfile, args.include, args.exclude))
    visible = visible_device_ids()
    if runs_on_one_machine(args) and visible and not (args.include or args.exclude or args.num_gpus):
        hosts = {"localhost": visible}  # as the runner does: the ranks run on the GPUs the variable names
    return hosts


@dataclass(frozen=True)
class RankCommand:
    """How one rank of this machine is started: its command line and its whole environment."""

    argv: list[str]
    env: dict[str, str]


def local_rank_commands(args: NeoXArgs, user_script: str, user_args: list[str], environ: dict[str, str], *,
                        python: str = sys.executable) -> list[RankCommand]:
    """This machine's ranks as DeepSpeed's per-node launcher starts them from the world its runner hands it:
    one machine alone, or this node (node_rank) of a job started node by node."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.constants import CROSS_RANK, CROSS_SIZE

    hosts = node_hosts(args)
    one_machine = runs_on_one_machine(args)
    node = 0 if one_machine else args.node_rank
    nodes = list(hosts)
    devices = hosts[nodes[node]]
    first_rank = sum(len(hosts[name]) for name in nodes[:node])
    shared = {**environ, "MASTER_ADDR": "127.0.0.1" if one_machine else args.master_addr,
              "MASTER_PORT": str(args.master_port), "WORLD_SIZE": str(sum(map(len, hosts.values()))),
              CROSS_RANK: str(node), CROSS_SIZE: str(len(nodes)), "LOCAL_SIZE": str(len(devices))}
    get_accelerator().set_visible_devices_envs(shared, devices)
    return [RankCommand([python, "-u", user_script, f"--local_rank={local_rank}", *user_args],
                        {**shared, "RANK": str(first_rank + local_rank), "LOCAL_RANK": str(local_rank)})
            for local_rank in range(len(devices))]


def runner_command(args: NeoXArgs, user_script: str, user_args: list[str], *, cpu_only: bool,
                   python: str = sys.executable) -> list[str]:
    """DeepSpeed's runner as it is, run by this Python, for a job with ranks on other machines: its own signal
    handler stops them. What its multi-node runner would refuse is refused here, in one line."""
    runner_argv = runner_arguments(args, user_script, user_args, cpu_only=cpu_only,
                                   runner_takes_log_level=runner_accepts_log_level())
    check_multi_node_runner(args, runner_argv)
    return [python, "-m", "deepspeed.launcher.runner", *runner_argv]


def port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's rendezvous store binds
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True


# Ports the system hands out for outgoing connections (gloo's, a browser's): a port picked from that
# range may be taken by one of them in the seconds before rank 0 binds it.
EPHEMERAL_PORTS_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PICKED_PORT = 20000


def free_port() -> int:
    """A free port below the system's ephemeral range, at random so that runs started together differ."""
    try:
        ephemeral_low = int(EPHEMERAL_PORTS_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    candidates = range(LOWEST_PICKED_PORT, max(ephemeral_low, LOWEST_PICKED_PORT + 1000))
    for port in random.sample(candidates, 64):
        if port_is_free(port):
            return port
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def rendezvous_port(args: NeoXArgs) -> int:
    """The master_port for this run. On a single node: a free port unless the user set one, and a
    user's port must be free; on several nodes the setting as it is (the master is another machine)."""
    if not runs_on_one_machine(args):
        return args.master_port
    if not args.set_by_user("master_port"):
        return free_port()
    if not port_is_free(args.master_port):
        raise ConfigError(
            f"{args.source_of('master_port')}: master_port: port {args.master_port} is already in use on this "
            "machine (another run?); choose another port, or remove master_port and a free one is picked"
        )
    return args.master_port
