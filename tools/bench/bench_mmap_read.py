"""Memory of reading a model-states file: torch.load with mmap=True against without, 1 and 2 readers.

    python tools/bench/bench_mmap_read.py [--file PATH | --size-mb 128] [--repeats 1] [--json PATH]

Each reader is a fresh subprocess (clean RSS) that loads the file with
``torch.load(path, map_location="cpu", mmap=..., weights_only=True)`` and reads every byte of every
tensor, as a load into a model would. With two readers both load at once and are measured while both
still hold the result: the claim under test is that ranks on one node share the pages of a
memory-mapped checkpoint instead of each holding a private copy.

Per reader (growth from just before the load to after it, in MiB):

* RSS / PSS: /proc/self/smaps_rollup totals (PSS splits each shared page among its users);
* ckpt PSS: PSS of the mapped checkpoint file plus anonymous PSS growth: what the checkpoint costs,
  undisturbed by other processes that share this one's libraries;
* peak: peak RSS during the load (VmHWM after resetting it).

Without ``--file`` a file shaped like a DeepSpeed model-states file (``module`` of bf16 tensors plus
plain client state) is written to a temporary directory. The file is read once beforehand so every
reader finds it in the page cache.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import Ratios, bench_parser, repeat_ratios, table, write_json
from procmem import mapped_file_kib, measure_memory, smaps_rollup_kib

TENSOR_MIB = 8


def write_model_states_file(path: Path, size_mib: int) -> None:
    import torch

    count = max(1, size_mib // TENSOR_MIB)
    elements = TENSOR_MIB * 2**20 // 2  # bf16
    generator = torch.Generator().manual_seed(0)
    module = {
        f"sequential.{i + 2}.mlp.dense.weight": torch.randn(elements, generator=generator).to(torch.bfloat16)
        for i in range(count)
    }
    torch.save({"module": module, "iteration": 0, "dp_world_size": 1, "mp_world_size": 1}, path)


def warm_page_cache(path: Path) -> None:
    with path.open("rb") as handle:
        while handle.read(16 * 2**20):
            pass


# --- reader (child process) ------------------------------------------------------------------------

def _wait_for(word: str) -> None:
    line = sys.stdin.readline().strip()
    if line != word:
        raise SystemExit(f"reader expected {word!r} from the benchmark, got {line!r}")


def _ckpt_pss_kib(path: Path, rollup: dict[str, int]) -> int:
    return mapped_file_kib(path)["Pss"] + rollup.get("Pss_Anon", rollup.get("Anonymous", 0))


def read_every_byte(state: dict) -> int:
    import torch

    touched = 0
    for value in state["module"].values():
        if isinstance(value, torch.Tensor) and value.numel():
            value.max()  # a reduction reads every element without a temporary copy
            touched += value.numel() * value.element_size()
    return touched


def reader(path: Path, use_mmap: bool) -> None:
    import torch

    print("ready", flush=True)
    _wait_for("go")
    before = smaps_rollup_kib() or {}
    before_ckpt = _ckpt_pss_kib(path, before)
    start = time.perf_counter()

    def load_and_read() -> tuple[dict, int]:
        state = torch.load(path, map_location="cpu", mmap=use_mmap, weights_only=True)
        return state, read_every_byte(state)

    (state, touched), peak = measure_memory(load_and_read)
    seconds = time.perf_counter() - start
    print("loaded", flush=True)
    _wait_for("report")  # every reader holds its state now
    after = smaps_rollup_kib() or {}
    report = {
        "rss": (after.get("Rss", 0) - before.get("Rss", 0)) / 1024,
        "pss": (after.get("Pss", 0) - before.get("Pss", 0)) / 1024,
        "ckpt_pss": (_ckpt_pss_kib(path, after) - before_ckpt) / 1024,
        "peak": peak.peak_growth_mib,
        "seconds": seconds,
        "touched_mib": touched / 2**20,
        "have_rollup": bool(before),
    }
    print(json.dumps(report), flush=True)
    del state


# --- benchmark (parent process) --------------------------------------------------------------------

def _expect(process: subprocess.Popen, word: str) -> None:
    line = process.stdout.readline().strip()
    if line != word:
        process.kill()
        raise SystemExit(f"reader {process.pid} said {line!r} instead of {word!r}; its stderr: "
                         f"{process.stderr.read()[-2000:]}")


def _tell(processes: list[subprocess.Popen], word: str) -> None:
    for process in processes:
        process.stdin.write(word + "\n")
        process.stdin.flush()


def run_readers(path: Path, use_mmap: bool, count: int) -> list[dict]:
    command = [sys.executable, str(Path(__file__).resolve()), "--reader", "--file", str(path)]
    if use_mmap:
        command.append("--mmap")
    processes = [subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for _ in range(count)]
    try:
        for process in processes:
            _expect(process, "ready")
        _tell(processes, "go")
        for process in processes:
            _expect(process, "loaded")
        _tell(processes, "report")
        reports = [json.loads(process.stdout.readline()) for process in processes]
        for process in processes:
            if process.wait(timeout=60) != 0:
                raise SystemExit(f"reader {process.pid} failed: {process.stderr.read()[-2000:]}")
        return reports
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, repeats=1, threads=None)
    parser.add_argument("--file", type=Path, help="a model-states file to read (default: write one)")
    parser.add_argument("--size-mb", type=int, default=128, help="size of the written file, MiB")
    parser.add_argument("--reader", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mmap", action="store_true", help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.reader:
        reader(options.file, options.mmap)
        return 0

    with tempfile.TemporaryDirectory(prefix="bench_mmap_read_") as scratch:
        path = options.file
        if path is None:
            path = Path(scratch) / "mp_rank_00_model_states.pt"
            write_model_states_file(path, options.size_mb)
        warm_page_cache(path)
        load_before = os.getloadavg()
        results: dict[tuple[int, bool], list[dict]] = {}
        for _ in range(options.repeats):
            for count in (1, 2):
                for use_mmap in (False, True):
                    results.setdefault((count, use_mmap), []).append(run_readers(path, use_mmap, count))
        load_average = (load_before[0], os.getloadavg()[0])
        file_mib = path.stat().st_size / 2**20

    def per_reader(key: tuple[int, bool], field: str) -> float:
        return statistics.median(report[field] for run in results[key] for report in run)

    def total(key: tuple[int, bool], field: str) -> float:
        return statistics.median(sum(report[field] for report in run) for run in results[key])

    print(f"file: {file_mib:.1f} MiB ({path.name}); repeats {options.repeats}; {os.cpu_count()} CPUs; "
          f"load average before {load_average[0]:.2f}, after {load_average[1]:.2f}")
    if not results[(1, True)][0][0]["have_rollup"]:
        print("no /proc/self/smaps_rollup: RSS/PSS columns read 0")
    rows = []
    for count in (1, 2):
        for use_mmap in (False, True):
            key = (count, use_mmap)
            rows.append([count, "mmap" if use_mmap else "no mmap", per_reader(key, "rss"), per_reader(key, "pss"),
                         per_reader(key, "ckpt_pss"), total(key, "ckpt_pss"), per_reader(key, "peak"),
                         per_reader(key, "seconds")])
    print(table(["readers", "torch.load", "RSS/reader MiB", "PSS/reader MiB", "ckpt PSS/reader MiB",
                 "ckpt PSS total MiB", "peak RSS/reader MiB", "load+read s"], rows))
    def per_run(key: tuple[int, bool], field: str) -> list[float]:
        return [sum(report[field] for report in run) for run in results[key]]

    ratios = Ratios()

    def ratio(name: str, numerator: tuple, denominator: tuple, field: str, meaning: str, value=total) -> None:
        ratios.add(name, value(numerator, field), value(denominator, field), meaning,
                   repeat_ratios(per_run(numerator, field), per_run(denominator, field)))

    ratio("mmap/no_mmap rss 1reader", (1, True), (1, False), "rss", "RSS growth of one reader", value=per_reader)
    ratio("mmap/no_mmap pss 2readers", (2, True), (2, False), "pss",
          "summed PSS growth of two concurrent readers (smaps_rollup)")
    ratio("mmap/no_mmap ckpt_pss 2readers", (2, True), (2, False), "ckpt_pss",
          "node memory the checkpoint costs with two readers; 0.5 = pages fully shared")
    ratio("2readers/1reader ckpt_pss mmap", (2, True), (1, True), "ckpt_pss", "1.0 = a second reader adds nothing")
    ratio("2readers/1reader ckpt_pss no_mmap", (2, False), (1, False), "ckpt_pss",
          "2.0 = every reader holds its own copy")
    write_json(options, __doc__, ratios, load_average, file_mib=file_mib,
               results={f"{count} reader(s), {'mmap' if use_mmap else 'no mmap'}": runs
                        for (count, use_mmap), runs in results.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
