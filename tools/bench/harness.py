"""What every bench under tools/bench shares: its flags, the order of its repeats, its ratios and their spread,
the machine it ran on, and its JSON output (the input of docs/performance.md, see report.py).

Light on purpose (no torch or megatron import): bench_mmap_read.py and bench_startup.py time fresh processes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def bench_parser(doc: str, *, layers: int | None = None, hidden: int | None = None, heads: int | None = None,
                 vocab: int | None = None, seq: int | None = None, precision: str | None = None,
                 precisions: Sequence[str] = ("fp32", "bf16"), zero_stage: int | None = None,
                 zero_stages: Sequence[int] = (0, 1, 2, 3), ranks: int | None = None, repeats: int | None = None,
                 threads: int | None = 0) -> argparse.ArgumentParser:
    """A bench's parser with the flags the benches share, each at the bench's default (None: the bench has no
    such flag); ``--json`` always."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if ranks is not None:
        parser.add_argument("--ranks", type=int, default=ranks, help="ranks (processes on this machine)")
    model_flags = (("--layers", layers, "transformer layers"), ("--hidden", hidden, "hidden size"),
                   ("--heads", heads, "attention heads"), ("--vocab", vocab, "padded vocabulary size"),
                   ("--seq", seq, "sequence length"))
    for flag, default, meaning in model_flags:
        if default is not None:
            parser.add_argument(flag, type=int, default=default, help=meaning)
    if precision is not None:
        parser.add_argument("--precision", choices=precisions, default=precision)
    if zero_stage is not None:
        parser.add_argument("--zero-stage", type=int, choices=zero_stages, default=zero_stage)
    if repeats is not None:
        parser.add_argument("--repeats", type=int, default=repeats)
    if threads is not None:
        parser.add_argument("--threads", type=int, default=threads,
                            help="torch threads per rank" + ("" if threads else " (0: torch's default)"))
    parser.add_argument("--json", type=Path, help="also write the results here as JSON (the format report.py reads)")
    return parser


def in_turn(names: Sequence[str], repeat: int) -> list[str]:
    """The order of the measured calls in ``repeat``: rotated every repeat, so each takes every place in turn
    (for a baseline and a candidate: alternating) and none always runs on what the one before left behind."""
    shift = repeat % len(names)
    return [*names[shift:], *names[:shift]]


def variants_in_fresh_processes(script: str, variants: Sequence[str], repeats: int,
                                flags: Sequence[str]) -> tuple[dict[str, list[dict]], tuple[float, float]]:
    """Each of ``variants`` measured ``repeats`` times, each time by a fresh process (``script --variant V flags``,
    which prints its record as the last line of JSON), so no variant's freed memory hides another's; the variants
    take turns (in_turn). (the records by variant, the load average before and after)."""
    load_before = os.getloadavg()[0]
    records: dict[str, list[dict]] = {variant: [] for variant in variants}
    for repeat in range(repeats):
        for variant in in_turn(variants, repeat):
            done = subprocess.run([sys.executable, script, "--variant", variant, *flags], capture_output=True,
                                  text=True, check=False)
            if done.returncode != 0:
                raise SystemExit(f"{Path(script).name}: the {variant} process failed:\n{done.stderr[-3000:]}")
            records[variant].append(json.loads(done.stdout.strip().splitlines()[-1]))
    return records, (load_before, os.getloadavg()[0])


def repeat_ratios(numerators: Sequence[float], denominators: Sequence[float]) -> list[float]:
    """Each repeat's ratio (the calls of one repeat run one right after the other, under the same load)."""
    return [a / b if b else float("inf") for a, b in zip(numerators, denominators, strict=True)]


def slowest_rank(per_rank: Sequence[Sequence[float]]) -> list[float]:
    """Each repeat's largest value over the ranks (a step, a load: done when the slowest rank is)."""
    return [max(values) for values in zip(*per_rank, strict=True)]


def middle_half(values: Sequence[float]) -> tuple[float, float]:
    """The first and third quartiles of ``values``: the spread of the middle half, within the values' range
    (the inclusive method: the default one extrapolates beyond the extremes of a few repeats)."""
    if len(values) < 2:
        return values[0], values[0]
    quartiles = statistics.quantiles(values, n=4, method="inclusive")
    return quartiles[0], quartiles[2]


def ratio_line(name: str, value: float, meaning: str) -> str:
    """One greppable line per ratio: ``RATIO <name> = <value>  (<meaning>)``."""
    return f"RATIO {name} = {value:.3f}  ({meaning})"


class Ratios:
    """Prints each ratio as it is added and keeps it, with its per-repeat values, for the JSON."""

    def __init__(self) -> None:
        self.records: dict[str, dict] = {}

    def add(self, name: str, numerator: float, denominator: float, meaning: str,
            per_repeat: Sequence[float] | None = None) -> float:
        """The ratio of ``numerator`` (a median, usually) to ``denominator``; ``per_repeat``: the same ratio in
        each repeat, kept for the spread report.py shows (their median and middle half)."""
        value = numerator / denominator if denominator else float("inf")
        print(ratio_line(name, value, meaning))
        record = {"value": value, "meaning": meaning}
        if per_repeat:
            record["per_repeat"] = list(per_repeat)
        self.records[name] = record
        return value


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(h) for h in headers]] + [[f"{c:.3f}" if isinstance(c, float) else str(c) for c in row]
                                           for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)) for row in cells]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def step_table(seconds: dict[str, list[float]], peak_mib: dict[str, list[float]], names: Sequence[str]) -> str:
    """The table of a bench that times steps and their peak memory: per name, the median, min and max step
    in ms and the median peak RSS above the bench's start."""
    return table(["step", "median ms", "min ms", "max ms", "peak RSS above start (MiB)"],
                 [[name, 1e3 * statistics.median(seconds[name]), 1e3 * min(seconds[name]), 1e3 * max(seconds[name]),
                   statistics.median(peak_mib[name])] for name in names])


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def accelerator() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU only"


def machine() -> dict:
    """What ran the bench: the CPU, how many cores this process may use, memory, accelerator, versions."""
    memory_kib = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                      if line.startswith("MemTotal:"))
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0)),
            "memory_gib": round(memory_kib / 2**20, 1), "accelerator": accelerator(),
            "python": platform.python_version(), "torch": metadata.version("torch"),
            "deepspeed": metadata.version("deepspeed")}


def commit() -> str | None:
    """The repository's commit, with ``+changes`` where the tree differs from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        return head + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def command() -> str:
    """The command line that ran this bench, as run from the repository root."""
    script = Path(sys.argv[0]).resolve()
    shown = script.relative_to(REPO) if script.is_relative_to(REPO) else script
    return shlex.join(["python", str(shown), *sys.argv[1:]])


def jsonable(options: argparse.Namespace) -> dict:
    return {key: str(value) if isinstance(value, Path) else value for key, value in vars(options).items()}


def write_json(options: argparse.Namespace, doc: str, ratios: Ratios, load_average: Sequence[float] | None,
               **details) -> None:
    """Write the bench's results to ``--json`` (nothing without it): the bench (the first line of its ``doc``),
    the command, the machine, when, the options, the load average before and after, every ratio, and
    ``details`` (the bench's own measurements)."""
    if options.json is None:
        return
    results = {"bench": Path(sys.argv[0]).name, "summary": doc.strip().splitlines()[0], "command": command(),
               "machine": machine(), "commit": commit(),
               "finished": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               "options": jsonable(options), "load_average": list(load_average) if load_average else None,
               "ratios": ratios.records, **details}
    options.json.parent.mkdir(parents=True, exist_ok=True)
    options.json.write_text(json.dumps(results, indent=2) + "\n")
