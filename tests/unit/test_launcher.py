"""How deepy.py starts the ranks, checked against DeepSpeed: this machine's ranks as its per-node launcher starts
them (run for real), and the runner command for several machines as its runner parses it."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from deepspeed.launcher import runner
from deepspeed.launcher.multinode_runner import MVAPICHRunner, OpenMPIRunner, PDSHRunner, SlurmRunner

from megatron.launch.launcher import (
    free_port,
    local_rank_commands,
    rendezvous_port,
    runner_arguments,
    runner_command,
    starts_only_local_ranks,
)
from megatron.neox_arguments import ConfigError, NeoXArgs, load_args_on_rank
from megatron.neox_arguments.handover import handover_argv
from tests.unit.test_neox_args import TINY_RUN

HOSTFILE = "worker-0 slots=4\nworker-1 slots=4\n# a comment\nworker-2 slots=2\n"


@pytest.fixture
def hostfile(tmp_path):
    path = tmp_path / "hostfile"
    path.write_text(HOSTFILE)
    return str(path)


def launch_args(**launcher_settings) -> NeoXArgs:
    values = {**TINY_RUN, "train_micro_batch_size_per_gpu": 1, **launcher_settings}
    return NeoXArgs.from_dict(values, source="test", require_run_settings=True)


def ranks_deepspeed_would_start(parsed, cpu_only: bool) -> int:
    """What deepspeed.launcher.runner.main resolves from these flags (without starting anything)."""
    pool = runner.fetch_hostfile(parsed.hostfile) or {"localhost": 1 if cpu_only else 0}
    active = runner.parse_inclusion_exclusion(pool, parsed.include, parsed.exclude)
    active = runner.apply_num_nodes_and_gpus(active, parsed.num_nodes, parsed.num_gpus)
    return sum(len(slots) for slots in active.values())


def parsed_by_deepspeed(args: NeoXArgs, cpu_only: bool = True):
    argv = runner_arguments(args, "train.py", handover_argv(args), cpu_only=cpu_only)
    return runner.parse_args(argv)


LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE", "MASTER_ADDR",
                      "MASTER_PORT", "CUDA_VISIBLE_DEVICES")
RECORD_RANK = """import json, os, sys
names = {names!r}
record = {{"argv": sys.argv[1:], "env": {{name: os.environ.get(name) for name in names}}}}
open(os.path.join(os.environ["RECORD_DIR"], "rank" + os.environ["RANK"] + ".json"), "w").write(json.dumps(record))
"""


def started_by_deepspeeds_node_launcher(tmp_path, world: dict, node_rank: int, master_addr: str, master_port: int,
                                        script_args: list[str]) -> list[dict]:
    """The argv and launcher variables of each rank DeepSpeed's per-node launcher starts (run for real, its ranks a
    script that writes them down), in rank order."""
    script, records = tmp_path / "record_rank.py", tmp_path / "records"
    script.write_text(RECORD_RANK.format(names=LAUNCHER_VARIABLES))
    records.mkdir()
    world_info = runner.encode_world_info(world)
    command = [sys.executable, "-m", "deepspeed.launcher.launch", f"--world_info={world_info}",
               f"--node_rank={node_rank}", f"--master_addr={master_addr}", f"--master_port={master_port}",
               str(script), *script_args]
    subprocess.run(command, env={**os.environ, "RECORD_DIR": str(records)}, check=True, capture_output=True)
    found = [json.loads(path.read_text()) for path in records.iterdir()]
    return sorted(found, key=lambda record: int(record["env"]["RANK"]))


def as_started(tmp_path, args: NeoXArgs, script_args: list[str]) -> list[dict]:
    """Each rank deepy.py starts for `args`, as the record script would write it down."""
    commands = local_rank_commands(args, str(tmp_path / "record_rank.py"), script_args, {})
    assert all(command.argv[:3] == [sys.executable, "-u", str(tmp_path / "record_rank.py")] for command in commands)
    return [{"argv": command.argv[3:], "env": {name: command.env.get(name) for name in LAUNCHER_VARIABLES}}
            for command in commands]


def world_deepspeeds_runner_would_build(args: NeoXArgs, cpu_only: bool) -> dict[str, list[int]]:
    """The hosts and slots DeepSpeed's runner resolves from its own flags for these settings and encodes
    for its per-node launcher (deepspeed.launcher.runner.main, without starting anything)."""
    parsed = runner.parse_args(runner_arguments(args, "train.py", [], cpu_only=cpu_only))
    pool = runner.fetch_hostfile(parsed.hostfile) or {"localhost": 1 if cpu_only else 0}
    active = runner.parse_inclusion_exclusion(pool, parsed.include, parsed.exclude)
    return dict(runner.apply_num_nodes_and_gpus(active, parsed.num_nodes, parsed.num_gpus))


@pytest.mark.parametrize(("settings", "ranks"), [({}, 1), ({"num_gpus": 2}, 2), ({"num_gpus": 3}, 3)])
def test_one_machine_starts_its_ranks_as_deepspeeds_node_launcher_would(tmp_path, settings, ranks):
    # no runner and no per-node launcher process: deepy.py starts the ranks of the world the runner would build
    args = launch_args(master_port=29611, **settings)
    world = world_deepspeeds_runner_would_build(args, True)
    assert world == {"localhost": list(range(ranks))} and args.global_num_gpus == ranks
    expected = started_by_deepspeeds_node_launcher(tmp_path, world, 0, "127.0.0.1", 29611, ["--x"])
    assert len(expected) == ranks and as_started(tmp_path, args, ["--x"]) == expected


def test_the_ranks_get_their_settings_on_their_command_line():
    args = launch_args(num_gpus=2)
    commands = local_rank_commands(args, "train.py", handover_argv(args), {})
    assert [load_args_on_rank(command.argv[3:]).to_dict() for command in commands] == [args.to_dict()] * 2
    assert [command.argv[3] for command in commands] == ["--local_rank=0", "--local_rank=1"]


@pytest.mark.parametrize(
    ("settings", "expected_ranks"),
    [
        ({}, 10),
        ({"num_nodes": 2}, 8),
        ({"num_nodes": 2, "num_gpus": 3}, 6),
        ({"num_gpus": 1}, 3),
        ({"include": "worker-0@worker-1:0,2"}, 6),
        ({"include": "worker-2"}, 2),
        ({"exclude": "worker-1:0@worker-2"}, 7),
    ],
)
def test_hostfile_include_exclude_count_the_ranks_deepspeed_starts(hostfile, settings, expected_ranks):
    args = launch_args(hostfile=hostfile, **settings)
    parsed = parsed_by_deepspeed(args)
    assert parsed.hostfile == hostfile
    assert parsed.include == settings.get("include", "") and parsed.exclude == settings.get("exclude", "")
    assert args.global_num_gpus == expected_ranks
    assert ranks_deepspeed_would_start(parsed, cpu_only=True) == expected_ranks


def test_multi_node_launcher_flags(hostfile):
    args = launch_args(hostfile=hostfile, num_nodes=2, launcher="slurm", master_addr="10.0.0.1", master_port=6000)
    parsed = parsed_by_deepspeed(args)
    assert (parsed.launcher, parsed.master_addr, parsed.master_port, parsed.num_nodes) == ("slurm", "10.0.0.1", 6000, 2)
    assert parsed.num_gpus == -1  # every slot of the two hosts
    assert not starts_only_local_ranks(args)
    command = runner_command(args, "train.py", ["--x"], cpu_only=True, python="/usr/bin/python3")
    assert command[:3] == ["/usr/bin/python3", "-m", "deepspeed.launcher.runner"]  # its signal handler stops them
    assert command[-2:] == ["train.py", "--x"]


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({"include": "worker-9"}, r"include: Hostname 'worker-9' not found in hostfile"),
        ({"exclude": "worker-0:7"}, r"exclude: No slot '7' specified on host 'worker-0'"),
        ({"include": "worker-0", "exclude": "worker-1"}, r"accepts only one of them"),
    ],
)
def test_bad_resource_filters_are_config_errors(hostfile, settings, expected):
    with pytest.raises(ConfigError, match=expected):
        launch_args(hostfile=hostfile, **settings)


def test_bad_hostfile_is_a_config_error(tmp_path):
    bad = tmp_path / "hostfile"
    bad.write_text("worker-0 four slots\n")
    with pytest.raises(ConfigError, match=r"hostfile .*bad entry"):
        launch_args(hostfile=str(bad))


def test_settings_survive_the_multi_node_pdsh_command(hostfile):
    """pdsh hands the remote shell one string; the rank must still find its settings intact."""
    args = launch_args(hostfile=hostfile, num_nodes=2, master_addr="10.0.0.1")
    parsed = parsed_by_deepspeed(args)
    active = runner.apply_num_nodes_and_gpus(
        runner.parse_inclusion_exclusion(runner.fetch_hostfile(parsed.hostfile), "", ""), parsed.num_nodes, -1
    )
    pdsh_runner = PDSHRunner(parsed, runner.encode_world_info(active))
    command, _, _ = pdsh_runner.get_cmd({}, active)
    remote_command = " ".join(command[command.index("-w") + 2:])  # what pdsh runs in each host's shell
    rank_argv = shlex.split(remote_command)
    rank_argv = rank_argv[rank_argv.index("train.py") + 1:] + ["--local_rank=3"]
    assert load_args_on_rank(rank_argv).to_dict() == args.to_dict()


@pytest.mark.parametrize("setting", ["deepspeed_slurm", "deepspeed_mpi"])
def test_slurm_and_mpi_ranks_are_started_by_the_multi_node_runner(setting):
    parsed = parsed_by_deepspeed(launch_args(**{setting: True, "launcher": "slurm"}))
    assert parsed.force_multi and parsed.launcher == "slurm"
    assert not parsed_by_deepspeed(launch_args()).force_multi


def test_deepspeed_slurm_ranks_take_rank_and_world_size_from_slurm(monkeypatch):
    from megatron.runtime.initialize import _rank_environment_from_launcher

    for name, value in {"SLURM_LOCALID": "1", "SLURM_PROCID": "5", "SLURM_NNODES": "2",
                        "SLURM_NTASKS_PER_NODE": "4"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("SLURM_NTASKS", raising=False)
    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE"):
        monkeypatch.setenv(name, "")  # recorded, so that what the call sets is undone after the test
        monkeypatch.delenv(name)
    args = launch_args(deepspeed_slurm=True)
    _rank_environment_from_launcher(args.deepspeed_mpi, args.deepspeed_slurm, args.master_port)
    assert (os.environ["LOCAL_RANK"], os.environ["RANK"], os.environ["WORLD_SIZE"]) == ("1", "5", "8")


def test_a_hostfile_missing_on_a_single_node_runs_here_as_deepspeed_does(tmp_path):
    args = launch_args(hostfile=str(tmp_path / "absent"))
    assert args.hostfile is None and args.global_num_gpus == 1
    assert any("does not exist; running on this machine only" in notice for notice in args.notices)
    assert starts_only_local_ranks(args) and len(local_rank_commands(args, "train.py", [], {})) == 1


# --- several nodes: DeepSpeed's multi-node runners, and each node started by itself (node_rank) -----------

UNIFORM_HOSTFILE = "worker-0 slots=4\nworker-1 slots=4\nworker-2 slots=4\n"
RUNNER_CLASSES = {"pdsh": PDSHRunner, "openmpi": OpenMPIRunner, "mvapich": MVAPICHRunner, "slurm": SlurmRunner}


def multi_node_command(args: NeoXArgs) -> tuple[list[str], dict[str, list[int]], list[str]]:
    """(the backend's command, the hosts and slots it starts, the argv one rank gets) as
    deepspeed.launcher.runner.main builds them for the multi-node path, from deepy.py's flags."""
    parsed = parsed_by_deepspeed(args, cpu_only=False)
    pool = runner.fetch_hostfile(parsed.hostfile)
    active = runner.apply_num_nodes_and_gpus(
        runner.parse_inclusion_exclusion(pool, parsed.include, parsed.exclude), parsed.num_nodes, parsed.num_gpus)
    world_info = runner.encode_world_info(active)
    backend_class = RUNNER_CLASSES[parsed.launcher]
    if backend_class is PDSHRunner:
        command = backend_class(parsed, world_info).get_cmd({}, active)[0]
        rank_argv = shlex.split(" ".join(command[command.index("-w") + 2:]))  # one string for the remote shell
    else:
        command = backend_class(parsed, world_info, pool).get_cmd({}, active)
        rank_argv = command
    return command, active, rank_argv[rank_argv.index("train.py") + 1:]


@pytest.mark.parametrize(("launcher", "settings", "hosts"), [
    # GPT-NeoX's README: a hostfile, pdsh by default, include/exclude/num_nodes to pick hosts
    ("pdsh", {"include": "worker-0@worker-2"}, {"worker-0": 4, "worker-2": 4}),
    ("pdsh", {"exclude": "worker-1:0,1"}, {"worker-0": 4, "worker-1": 2, "worker-2": 4}),
    ("pdsh", {"num_nodes": 2}, {"worker-0": 4, "worker-1": 4}),
    # launcher: openmpi / mvapich with deepspeed_mpi: mpirun starts every slot of the hostfile
    ("openmpi", {"deepspeed_mpi": True}, {"worker-0": 4, "worker-1": 4, "worker-2": 4}),
    ("mvapich", {"deepspeed_mpi": True}, {"worker-0": 4, "worker-1": 4, "worker-2": 4}),
    # launcher: slurm with deepspeed_slurm: srun starts the ranks
    ("slurm", {"deepspeed_slurm": True, "num_nodes": 2}, {"worker-0": 4, "worker-1": 4}),
])
def test_each_multi_node_command_deepy_builds_is_the_one_deepspeed_runs(tmp_path, monkeypatch, launcher, settings,
                                                                        hosts):
    from deepspeed.launcher import multinode_runner

    monkeypatch.setattr(multinode_runner, "MVAPICH_TMP_HOSTFILE", str(tmp_path / "mvapich_hosts"))  # not /tmp's
    path = tmp_path / "hostfile"
    path.write_text(UNIFORM_HOSTFILE)
    args = launch_args(hostfile=str(path), launcher=launcher, master_addr="10.0.0.1", master_port=6000, **settings)
    command, active, rank_argv = multi_node_command(args)
    assert {host: len(slots) for host, slots in active.items()} == hosts
    assert args.global_num_gpus == sum(hosts.values())
    ranks = str(args.global_num_gpus)
    if launcher == "pdsh":
        assert command[command.index("-w") + 1] == ",".join(hosts)
        assert "--master_addr=10.0.0.1" in command and "--master_port=6000" in command
    elif launcher == "openmpi":
        assert command[:5] == ["mpirun", "-n", ranks, "-hostfile", str(path)]
    elif launcher == "mvapich":
        assert command[:4] == ["mpirun", "-np", ranks, "-ppn"] and command[4] == "4"
        assert (tmp_path / "mvapich_hosts").read_text().split() == list(hosts)
    else:
        assert command[:3] == ["srun", "-n", ranks]
        assert command[command.index("--nodes") + 1] == "2"
    assert load_args_on_rank([*rank_argv, "--local_rank=0"]).to_dict() == args.to_dict()


@pytest.mark.parametrize("settings", [{"num_gpus": 2}, {"num_nodes": 2}, {"include": "worker-0"}])
@pytest.mark.parametrize("launcher", ["openmpi", "mvapich"])
def test_what_deepspeeds_mpi_runners_refuse_stops_deepy_with_one_line(hostfile, launcher, settings):
    args = launch_args(hostfile=hostfile, launcher=launcher, master_addr="10.0.0.1", **settings)
    with pytest.raises(ConfigError, match=rf"launcher: {launcher}: DeepSpeed says: .*does not support"):
        runner_command(args, "train.py", [], cpu_only=False)


def test_a_launcher_stock_deepspeed_lacks_is_a_config_error():
    with pytest.raises(ConfigError, match=r"launcher.*jsrun"):
        launch_args(launcher="jsrun")


def test_node_rank_starts_this_nodes_ranks_as_deepspeeds_node_launcher_would(tmp_path, hostfile):
    args = launch_args(hostfile=hostfile, num_nodes=2, node_rank=1, master_addr="10.0.0.1", master_port=6000)
    assert starts_only_local_ranks(args)  # this node's ranks only, all local, on the port given
    # the whole job's nodes, in DeepSpeed's order: this node's ranks are 4-7 of 8
    world = world_deepspeeds_runner_would_build(args, cpu_only=False)
    assert world == {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3]} and args.global_num_gpus == 8
    expected = started_by_deepspeeds_node_launcher(tmp_path, world, 1, "10.0.0.1", 6000, [])
    assert [record["env"]["RANK"] for record in expected] == ["4", "5", "6", "7"]
    assert as_started(tmp_path, args, []) == expected
    assert rendezvous_port(args) == 6000


@pytest.mark.parametrize(("settings", "expected"), [
    ({"node_rank": 3}, r"node_rank: 3, but the hostfile gives 3 node\(s\) \(worker-0, worker-1, worker-2\), "
                       r"numbered 0 to 2"),
    ({"node_rank": 1, "num_nodes": 1}, r"node_rank: 1, but the hostfile gives 1 node\(s\)"),
    ({"node_rank": -1}, r"node_rank: -1, but"),
    ({"node_rank": 0, "master_addr": None}, r"node_rank: 0 needs master_addr: the address of node 0 \(worker-0\)"),
    ({"node_rank": 0, "deepspeed_slurm": True}, r"node_rank: 0, but .*deepspeed_slurm has srun/mpirun start"),
])
def test_bad_node_rank_settings_are_config_errors(hostfile, settings, expected):
    with pytest.raises(ConfigError, match=expected):
        launch_args(hostfile=hostfile, **{"master_addr": "10.0.0.1", **settings})


def test_node_rank_without_a_hostfile_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"node_rank: 0 needs a hostfile naming every node"):
        launch_args(node_rank=0, master_addr="10.0.0.1")
    with pytest.raises(ConfigError, match=r"hostfile: .*absent' does not exist"):  # not run on this machine alone
        launch_args(node_rank=0, master_addr="10.0.0.1", hostfile=str(tmp_path / "absent"))


def test_dry_run_refuses_what_deepspeeds_mpi_runner_would(hostfile, tmp_path, capsys):
    import deepy
    from tests.e2e.test_dry_run import RANK_ECHO, write_yaml

    config = write_yaml(tmp_path, "mpi.yml", {**TINY_RUN, "hostfile": hostfile, "launcher": "openmpi", "num_gpus": 2,
                                              "master_addr": "10.0.0.1"})
    assert deepy.main([RANK_ECHO, str(config), "--dry-run"]) == 2
    assert "mpi.yml: launcher: openmpi: DeepSpeed says: " in capsys.readouterr().err


def test_the_ranks_find_this_package_first_on_their_path():
    # a train script anywhere imports this package: PYTHONPATH must name the folder holding the megatron
    # package, not a folder inside it (whose logging.py would shadow the stdlib's)
    from megatron.launch.launcher import PACKAGE_PARENT, launcher_environment

    first = Path(launcher_environment({}, cpu_only=True)["PYTHONPATH"].split(os.pathsep)[0])
    assert first == Path(PACKAGE_PARENT)
    assert (first / "megatron" / "launch" / "launcher.py").is_file()


def test_a_picked_port_lies_below_the_ports_handed_to_outgoing_connections():
    # A port from the ephemeral range can be taken by another job's gloo connection in the seconds
    # before rank 0 binds it (a CI run saw "master_port ... already in use" that way).
    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {free_port() for _ in range(8)}
    assert all(20000 <= port < ephemeral_low for port in ports), ports
    assert len(ports) > 1  # runs started together do not all pick one port
