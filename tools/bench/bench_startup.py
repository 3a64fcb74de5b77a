"""Start-up: from ``python deepy.py ...`` to the end of the first training step of the tiny model, by phase.

    python tools/bench/bench_startup.py [--ranks 1|2] [--repeats 3] [--json PATH]

A first run of configs/tiny.yml (two steps) builds the embedded corpus's cache (if not yet there) and
saves global_step1; every timed run then resumes from it (`load`, `iteration: 1`, no `save`) and trains one step, so
the load is part of the start-up as after a restart. The rank script is tools/bench/startup_rank.py:
train.py with each phase of setup() timed where it runs. Phases, rank 0's (the slowest rank's end of
the first step for the total):

* deepy.py: its own work before it starts the ranks (imports, settings, tokenizer and corpus resolution), up
  to the line in which it shows the ranks' command;
* rank start: the rest of the time until the rank's interpreter runs its first line;
* imports, process group, tokenizer, load plan, model, engine, load, data, first step: as timed in the
  rank; "other" is the time between them (seeds, checks, logging);
* end (not in the total): from the end of the first step to deepy.py's exit: the run's closing (its last
  evaluation batch) and the ends of the ranks and deepy.py.

The baseline, ``floor``: the same deepy.py launch of a rank that only imports torch and DeepSpeed and
joins the gloo process group. ``RATIO startup/floor wall`` is the whole start-up against it;
``RATIO ours/startup wall`` the share after the floor's own phases.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from harness import REPO, Ratios, bench_parser, in_turn, repeat_ratios, write_json

sys.path.insert(0, str(REPO))

from megatron.launch.launcher import free_port  # noqa: E402

RANK_SCRIPT = "tools/bench/startup_rank.py"
ORDER = ("deepy.py", "rank start", "imports", "process group", "tokenizer", "load plan", "model", "engine", "load",
         "data", "first step", "other")


def write_config(path: Path, ranks: int, **settings) -> Path:
    base = {"num_gpus": ranks, "log_interval": 1, "eval_interval": 1000, "eval_iters": 1,
            "tensorboard_dir": None, "master_port": free_port()}
    path.write_text(yaml.safe_dump({**base, **settings}, sort_keys=False))
    return path


def deepy(config: Path, out_dir: Path, floor: bool = False) -> tuple[float, float, float]:
    """Run deepy.py on configs/tiny.yml + `config`: when it started, showed the ranks' command, exited."""
    env = {**os.environ, "BENCH_STARTUP_DIR": str(out_dir), "PYTHONUNBUFFERED": "1"}
    if floor:
        env["BENCH_STARTUP_FLOOR"] = "1"
    command = [sys.executable, "deepy.py", RANK_SCRIPT, "configs/tiny.yml", str(config)]
    start = time.time()
    launched = None
    run = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = []
    for line in run.stdout:
        if launched is None and line.startswith("deepy.py: ranks "):
            launched = time.time()
        output.append(line)
    if run.wait(timeout=900) != 0 or launched is None:
        raise SystemExit(f"{' '.join(command)} exited {run.returncode}:\n{''.join(output)[-6000:]}")
    return start, launched, time.time()


def breakdown(start: float, launched: float, exited: float, ranks: list[dict]) -> dict[str, float]:
    """Seconds per phase of rank 0, 'total' to the slowest rank's end of its first step, 'end' from there to
    deepy.py's exit."""
    rank0 = ranks[0]
    phases = {"deepy.py": launched - start, "rank start": rank0["started"] - launched,
              "imports": rank0["imported"] - rank0["started"]}
    for name, begin, end in rank0["phases"]:
        phases[name] = phases.get(name, 0.0) + end - begin
    phases["total"] = max(rank["first_step"] for rank in ranks) - start
    phases["other"] = rank0["first_step"] - start - sum(v for k, v in phases.items() if k != "total")
    phases["end"] = exited - max(rank["first_step"] for rank in ranks)
    return phases


def timed_run(config: Path, scratch: Path, ranks: int, floor: bool) -> dict[str, float]:
    out = Path(tempfile.mkdtemp(dir=scratch))
    start, launched, exited = deepy(config, out, floor=floor)
    return breakdown(start, launched, exited, [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)])


def main(argv: list[str] | None = None) -> int:
    options = bench_parser(__doc__, ranks=1, repeats=3, threads=None).parse_args(argv)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench_startup_") as name:
        scratch = Path(name)
        checkpoint = scratch / "checkpoint"
        first = write_config(scratch / "first.yml", options.ranks, save=str(checkpoint), load=None, train_iters=2,
                             checkpoint_factor=1)
        deepy(first, scratch)  # corpus cache and the checkpoint every timed run loads
        resume = write_config(scratch / "resume.yml", options.ranks, save=None, load=str(checkpoint), train_iters=2,
                              iteration=1)
        runs: dict[str, list[dict[str, float]]] = {"startup": [], "floor": []}
        for repeat in range(options.repeats):
            for kind in in_turn(["startup", "floor"], repeat):
                runs[kind].append(timed_run(resume, scratch, options.ranks, floor=kind == "floor"))
    load_average = (load_before, os.getloadavg()[0])
    medians = {kind: {key: statistics.median(run[key] for run in samples) for key in samples[0]}
               for kind, samples in runs.items()}
    print(f"tiny model (configs/tiny.yml), {options.ranks} rank(s), resumed from a checkpoint, {options.repeats} "
          f"repeats, {os.cpu_count()} CPUs, load average before {load_average[0]:.2f}, after {load_average[1]:.2f}")
    print(f"{'phase':<14} {'startup s':>10} {'floor s':>8}")
    for phase in (*ORDER, "total", "end"):
        if phase in medians["startup"]:
            floor_value = medians["floor"].get(phase)
            print(f"{phase:<14} {medians['startup'][phase]:>10.2f} "
                  f"{'-' if floor_value is None else f'{floor_value:.2f}':>8}")
    total, floor_total = medians["startup"]["total"], medians["floor"]["total"]
    floor_phases = ("deepy.py", "rank start", "process group")
    ours = total - sum(medians["startup"][phase] for phase in floor_phases)
    spread = repeat_ratios([run["total"] for run in runs["startup"]], [run["total"] for run in runs["floor"]])
    ratios = Ratios()
    ratios.add("startup/floor wall", total, floor_total, f"per repeat {min(spread):.2f}-{max(spread):.2f}; from "
               "`python deepy.py` to the end of the first step, against a rank that only imports and joins", spread)
    ratios.add("ours/startup wall", ours, total, "all but deepy.py, the rank's start and the process group")
    write_json(options, __doc__, ratios, load_average, medians=medians, runs=runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
