"""Packed against padded SFT on the same records: trained tokens per second.

    python tools/bench/bench_sft_packing.py [--layers 2] [--hidden 128] [--heads 4] [--vocab 1024] [--seq 2048]
        [--records 64] [--micro 1] [--steps 4] [--repeats 2] [--threads 0] [--json PATH]

The same SFT records (a masked prompt, a trained response and the eod; lengths drawn uniformly from seq/16 to
seq/2 tokens) are written as token and label files and read the two ways, by the same Llama-family model in one
DeepSpeed engine (fp32, ZeRO-0, Adam) on one process:

| row      | data                                                                                              |
| `padded` | pack_impl unpacked: one record per row, padded to seq_length                                     |
| `packed` | pack_impl pack_until_overflow with reset_attention_mask and reset_position_ids (block-causal SDPA) |

Each repeat times `--steps` optimizer steps of each (after one untimed warm-up step of each), the order
alternating. The loss trains the same tokens per record both ways; what differs is how many rows carry them.
Ratio `packed/padded trained_tokens_per_second`: trained (loss-masked-in) tokens per second.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from harness import Ratios, bench_parser, in_turn, repeat_ratios, table, write_json  # noqa: E402

ROWS = ("padded", "packed")
EOD, MASKED = 1, -100


def write_records(directory: Path, options: argparse.Namespace):
    """(tokens, labels) indexed datasets of ``options.records`` SFT records."""
    from megatron.data import MMapIndexedDataset, MMapIndexedDatasetBuilder

    rng = np.random.RandomState(0)
    files = {name: MMapIndexedDatasetBuilder(str(directory / f"{name}.bin"), np.int32) for name in ("text", "label")}
    for _ in range(options.records):
        length = rng.randint(options.seq // 16, options.seq // 2)
        prompt = rng.randint(2, options.vocab, length // 2)
        response = rng.randint(2, options.vocab, length - len(prompt) - 1)
        files["text"].add_item(np.concatenate([prompt, response, [EOD]]))
        files["label"].add_item(np.concatenate([np.full(len(prompt), MASKED), response, [EOD]]))
    for name, builder in files.items():
        builder.end_document()
        builder.finalize(str(directory / f"{name}.idx"))
    return MMapIndexedDataset(str(directory / "text")), MMapIndexedDataset(str(directory / "label"))


def row_batches(dataset, micro: int):
    """Micro batches of ``micro`` rows, cycling through the dataset."""
    import torch

    index = 0
    while True:
        rows = [dataset[(index + i) % len(dataset)] for i in range(micro)]
        index += micro
        yield {key: torch.stack([torch.from_numpy(row[key]) for row in rows]) for key in ("text", "label")}


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, layers=2, hidden=128, heads=4, vocab=1024, seq=2048, repeats=2)
    parser.add_argument("--records", type=int, default=64, help="SFT records written")
    parser.add_argument("--micro", type=int, default=1, help="micro batch size (rows)")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps timed per repeat")
    options = parser.parse_args(argv)

    import bench_world as world

    from megatron.data import BatchOptions
    from megatron.data.gpt_dataset import GPTDataset
    from megatron.model import build_model
    from megatron.neox_arguments import NeoXArgs
    from megatron.objectives.language_model import LanguageModelLoss

    world.measuring_process(options.threads)
    world.init_world()
    load_before = os.getloadavg()[0]
    args = NeoXArgs.from_dict(world.model_settings(options, **world.LLAMA, mlp_multiple_of=32,
                                                   train_micro_batch_size_per_gpu=options.micro))
    engine = world.build_engine(build_model(args.architecture(), args.seed),
                                world.deepspeed_config(options.micro, 0, "fp32"))
    options_of = {"padded": BatchOptions(),
                  "packed": BatchOptions(eod=EOD, reset_position_ids=True, reset_attention_mask=True)}
    with tempfile.TemporaryDirectory(prefix="bench_sft_packing_") as scratch:
        text, label = write_records(Path(scratch), options)
        samples = options.micro * (options.steps * options.repeats + 1)
        batches = {}
        for name, pack_impl in (("padded", "unpacked"), ("packed", "pack_until_overflow")):
            dataset = GPTDataset(name, text, np.arange(options.records), samples, options.seq, 1234,
                                 pack_impl=pack_impl, label_dataset=label, index_cache_dir=scratch)
            batches[name] = row_batches(dataset, options.micro)

        def step(name: str) -> int:
            batch = next(batches[name])
            loss, _ = LanguageModelLoss(options_of[name])(engine, batch)
            engine.backward(loss)
            engine.step()
            return int((batch["label"][:, 1:] >= 0).sum())

        for name in ROWS:
            step(name)  # warm-up
        rates: dict[str, list[float]] = {name: [] for name in ROWS}
        for repeat in range(options.repeats):
            for name in in_turn(ROWS, repeat):
                started, trained = time.perf_counter(), 0
                for _ in range(options.steps):
                    trained += step(name)
                rates[name].append(trained / (time.perf_counter() - started))
    load_average = (load_before, os.getloadavg()[0])
    print(f"Llama family, {options.layers} layers, hidden {options.hidden}, fp32, one process; {options.records} "
          f"records of {options.seq // 16}-{options.seq // 2} tokens, rows of {options.seq}; micro batch "
          f"{options.micro}; repeats {options.repeats}; load average {load_average[0]:.1f} -> {load_average[1]:.1f}")
    print(table(["row", "trained tokens/s"], [[name, statistics.median(rates[name])] for name in ROWS]))
    report = Ratios()
    report.add("packed/padded trained_tokens_per_second", statistics.median(rates["packed"]),
               statistics.median(rates["padded"]), "SFT throughput of packed rows (block-causal) against padded rows",
               repeat_ratios(rates["packed"], rates["padded"]))
    write_json(options, __doc__, report, load_average, trained_tokens_per_second=rates)
    return 0


if __name__ == "__main__":
    sys.exit(main())
