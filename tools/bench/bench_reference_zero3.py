"""Host memory per rank of DPO/KTO's frozen reference model under ZeRO-3 (partitioned) against ZeRO-1 (whole).

    python tools/bench/bench_reference_zero3.py [--ranks 2] [--layers 8] [--hidden 512] [--heads 8]
        [--vocab 32000] [--seq 256] [--rows 4] [--precision fp32|bf16] [--threads N] [--json PATH]

Once per ZeRO stage (1, then 3), a fresh gloo world of ``--ranks`` processes; each rank builds the reference
exactly as training does (``megatron.training.loop.frozen_reference_engine``: the model built again, under ZeRO-3
inside ``deepspeed.zero.Init`` over the data-parallel group, frozen, in a forward-only engine), then runs the
reference's part of a preference step: the log-probabilities of ``--rows`` sequences of ``--seq`` tokens
(``megatron.objectives.log_probs.target_log_probs`` without gradients), where ZeRO-3 gathers each layer for its
forward and frees it after. The checkpoint load is left out: it writes the weights in place and keeps no more.

Memory is the rank's anonymous memory (smaps_rollup ``Anonymous``), against its reading before the build:
"held" is what the built reference keeps, "forward peak" the most during the forward (held included). Each is
the largest over the ranks. ``RATIO`` lines: ZeRO-3 against ZeRO-1 for both, and each against the whole model's
weights in the run's precision.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_world as world  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from bench_dpo_step import llama_settings  # noqa: E402
from harness import Ratios, bench_parser, table, write_json  # noqa: E402
from procmem import PeakSampler, smaps_rollup_kib  # noqa: E402

from megatron.data import BatchOptions, get_batch  # noqa: E402
from megatron.objectives.log_probs import target_log_probs  # noqa: E402
from megatron.runtime.initialize import current_device  # noqa: E402
from megatron.training.loop import frozen_reference_engine  # noqa: E402

STAGES = (1, 3)


def anonymous_mib() -> float:
    return (smaps_rollup_kib() or {}).get("Anonymous", 0) / 1024


def measure_rank(options: argparse.Namespace, stage: int) -> dict:
    args = llama_settings(options, options.rows, stage)
    sampler = PeakSampler(fields=("Anonymous",))
    text = torch.randint(0, options.vocab, (options.rows, options.seq + 1), generator=torch.Generator().manual_seed(0))
    batch = get_batch({"text": text, "label": text}, BatchOptions()).to(current_device())
    dist.barrier()
    start = anonymous_mib()
    reference, build_peak = sampler.measure(lambda: frozen_reference_engine(args))
    held = anonymous_mib() - start
    parameters = sum(getattr(p, "ds_tensor", p).numel() for p in reference.module.parameters())  # this rank's
    dist.barrier()
    with torch.no_grad():
        log_probs, forward_growth = sampler.measure(lambda: target_log_probs(reference, batch, fp32=True))
    return {"parameters": parameters, "held_mib": held, "build_peak_mib": build_peak,
            "forward_peak_mib": held + forward_growth, "log_prob_sum": float(log_probs.sum())}


@world.leaves_the_world
def rank_main(rank: int, options: argparse.Namespace, port: int, scratch: str, stage: int) -> None:
    world.measuring_process(options.threads)
    world.init_world(rank, options.ranks, port)
    (Path(scratch) / f"zero{stage}-rank{rank}.json").write_text(json.dumps(measure_rank(options, stage)))


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, ranks=2, layers=8, hidden=512, heads=8, vocab=32000, seq=256, precision="fp32")
    parser.add_argument("--rows", type=int, default=4, help="sequences per rank in the reference's forward")
    options = parser.parse_args(argv)

    load_before = os.getloadavg()[0]
    results: dict[int, list[dict]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for stage in STAGES:
            torch.multiprocessing.spawn(rank_main, args=(options, world.free_port(), scratch, stage),
                                        nprocs=options.ranks)
            results[stage] = [json.loads((Path(scratch) / f"zero{stage}-rank{rank}.json").read_text())
                              for rank in range(options.ranks)]
    whole = results[1][0]["parameters"]  # ZeRO-1: every rank holds the whole model
    weights_mib = whole * (2 if options.precision == "bf16" else 4) / 2**20
    load_average = (load_before, os.getloadavg()[0])
    print(f"model: {whole / 1e6:.1f}M parameters ({weights_mib:.0f} MiB of {options.precision} weights), "
          f"{options.layers} layers, hidden {options.hidden}, vocab {options.vocab}; forward of {options.rows} x "
          f"{options.seq} tokens per rank; {options.ranks} ranks on this machine, {os.cpu_count()} CPUs; load average "
          f"before {load_average[0]:.2f}, after {load_average[1]:.2f}")
    print(table(["ZeRO stage", "rank", "parameters held", "held MiB", "build peak MiB", "forward peak MiB"],
                [[stage, rank, r["parameters"], r["held_mib"], r["build_peak_mib"], r["forward_peak_mib"]]
                 for stage in STAGES for rank, r in enumerate(results[stage])]))

    def worst(stage: int, key: str) -> float:
        return max(r[key] for r in results[stage])

    report = Ratios()
    report.add("zero3/zero1 reference held", worst(3, "held_mib"), worst(1, "held_mib"),
               "memory the built reference keeps on a rank, partitioned against whole")
    report.add("zero3/zero1 reference forward peak", worst(3, "forward_peak_mib"), worst(1, "forward_peak_mib"),
               "the most during the reference's forward (layers gathered one at a time under ZeRO-3)")
    report.add("zero1 reference held/weights", worst(1, "held_mib"), weights_mib,
               "the whole reference on every rank, against its weights")
    report.add("zero3 reference held/weights", worst(3, "held_mib"), weights_mib,
               f"one rank's partition, against the whole weights (1/{options.ranks} would be an even split)")
    write_json(options, __doc__, report, load_average, results=results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
