"""Packed against padded SFT or DPO on the same records: trained tokens (SFT) or pairs (DPO) per second.

    python tools/bench/bench_sft_packing.py [--objective sft] [--layers 2] [--hidden 128] [--heads 4]
        [--vocab 1024] [--seq 2048] [--records 64] [--micro 1] [--steps 4] [--repeats 2] [--threads 0] [--json PATH]

The same records are written as token and label files and read the two ways, by the same Llama-family model in
one DeepSpeed engine (fp32, ZeRO-0, Adam) on one process. `--objective sft`: SFT records (a masked prompt, a
trained response and the eod; lengths drawn uniformly from seq/16 to seq/2 tokens). `--objective dpo`: pairs
(dataset_impl pairwise) of a shared masked prompt and a chosen and a rejected answer, each side seq/16 to seq/2
tokens, scored by DPO (beta 0.1) against a frozen reference model of the same shape.

| row      | data                                                                                              |
| `padded` | pack_impl unpacked: one record per row, padded to seq_length                                     |
| `packed` | pack_impl pack_until_overflow with reset_attention_mask and reset_position_ids (block-causal SDPA) |

Each repeat times `--steps` optimizer steps of each (after one untimed warm-up step of each), the order
alternating. The loss trains the same tokens per record both ways; what differs is how many rows carry them.
Ratio `packed/padded trained_tokens_per_second` (sft): trained (loss-masked-in) tokens per second;
`packed/padded pairs_per_second` (dpo): pairs scored per second.
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


def write_files(directory: Path, records: dict[str, list[np.ndarray]]) -> dict:
    """Each named list of documents as an indexed dataset in ``directory``."""
    from megatron.data import MMapIndexedDataset, MMapIndexedDatasetBuilder

    for name, documents in records.items():
        builder = MMapIndexedDatasetBuilder(str(directory / f"{name}.bin"), np.int32)
        for document in documents:
            builder.add_item(document)
            builder.end_document()
        builder.finalize(str(directory / f"{name}.idx"))
    return {name: MMapIndexedDataset(str(directory / name)) for name in records}


def sft_records(options: argparse.Namespace) -> dict[str, list[np.ndarray]]:
    """``options.records`` SFT records: text and label documents."""
    rng = np.random.RandomState(0)
    records = {"text": [], "label": []}
    for _ in range(options.records):
        length = rng.randint(options.seq // 16, options.seq // 2)
        prompt = rng.randint(2, options.vocab, length // 2)
        response = rng.randint(2, options.vocab, length - len(prompt) - 1)
        records["text"].append(np.concatenate([prompt, response, [EOD]]))
        records["label"].append(np.concatenate([np.full(len(prompt), MASKED), response, [EOD]]))
    return records


def pair_records(options: argparse.Namespace) -> dict[str, list[np.ndarray]]:
    """``options.records`` preference pairs: a shared prompt, a chosen and a rejected answer of their own lengths."""
    rng = np.random.RandomState(0)
    records = {"pos": [], "neg": [], "pos_label": [], "neg_label": []}
    for _ in range(options.records):
        prompt = rng.randint(2, options.vocab, options.seq // 32)
        for side in ("pos", "neg"):
            answer = rng.randint(2, options.vocab, rng.randint(options.seq // 16, options.seq // 2) - len(prompt))
            answer[-1] = EOD
            records[side].append(np.concatenate([prompt, answer]))
            records[f"{side}_label"].append(np.concatenate([np.full(len(prompt), MASKED), answer]))
    return records


def datasets(objective: str, files: dict, options: argparse.Namespace, samples: int, scratch: str) -> dict:
    """The padded and the packed dataset of the same records."""
    from megatron.data.gpt_dataset import GPTDataset
    from megatron.data.pairwise_dataset import PairwiseDataset

    made = {}
    for name, pack_impl in (("padded", "unpacked"), ("packed", "pack_until_overflow")):
        if objective == "sft":
            made[name] = GPTDataset(name, files["text"], np.arange(options.records), samples, options.seq, 1234,
                                    pack_impl=pack_impl, label_dataset=files["label"], index_cache_dir=scratch)
        else:
            made[name] = PairwiseDataset(name, files["pos"], files["neg"], np.arange(options.records), samples,
                                         options.seq, 1234, scratch, pack_impl, pos_label=files["pos_label"],
                                         neg_label=files["neg_label"])
    return made


def row_batches(dataset, micro: int):
    """Micro batches of ``micro`` rows, cycling through the dataset."""
    import torch

    index = 0
    while True:
        rows = [dataset[(index + i) % len(dataset)] for i in range(micro)]
        index += micro
        yield {key: torch.stack([torch.from_numpy(row[key]) for row in rows]) for key in rows[0]}


def counted(objective: str, batch: dict) -> int:
    """What a step of ``batch`` does: trained tokens (sft) or pairs scored (dpo)."""
    if objective == "sft":
        return int((batch["label"][:, 1:] >= 0).sum())
    if "pos_segment" in batch:
        return int((batch["pos_segment"].max(dim=1).values + 1).sum())
    return batch["pos"].shape[0]


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, layers=2, hidden=128, heads=4, vocab=1024, seq=2048, repeats=2)
    parser.add_argument("--objective", choices=("sft", "dpo"), default="sft", help="what the rows train")
    parser.add_argument("--records", type=int, default=64, help="SFT records or preference pairs written")
    parser.add_argument("--micro", type=int, default=1, help="micro batch size (rows)")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps timed per repeat")
    options = parser.parse_args(argv)

    import bench_world as world

    from megatron.data import BatchOptions
    from megatron.model import build_model
    from megatron.neox_arguments import NeoXArgs
    from megatron.objectives.dpo import DirectPreferenceOptimization
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
    if options.objective == "sft":
        objectives = {name: LanguageModelLoss(batch_options) for name, batch_options in options_of.items()}
    else:
        reference = build_model(args.architecture(), args.seed + 1).eval()
        objectives = {name: DirectPreferenceOptimization(batch_options, 0.1, True, reference)
                      for name, batch_options in options_of.items()}
    records = sft_records(options) if options.objective == "sft" else pair_records(options)
    with tempfile.TemporaryDirectory(prefix="bench_sft_packing_") as scratch:
        files = write_files(Path(scratch), records)
        samples = options.micro * (options.steps * options.repeats + 1)
        batches = {name: row_batches(dataset, options.micro)
                   for name, dataset in datasets(options.objective, files, options, samples, scratch).items()}

        def step(name: str) -> int:
            batch = next(batches[name])
            loss, _ = objectives[name](engine, batch)
            engine.backward(loss)
            engine.step()
            return counted(options.objective, batch)

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
    unit = "trained_tokens_per_second" if options.objective == "sft" else "pairs_per_second"
    print(f"{options.objective}; Llama family, {options.layers} layers, hidden {options.hidden}, fp32, one process; "
          f"{options.records} records of {options.seq // 16}-{options.seq // 2} tokens, rows of {options.seq}; micro "
          f"batch {options.micro}; repeats {options.repeats}; load average {load_average[0]:.1f} -> "
          f"{load_average[1]:.1f}")
    print(table(["row", unit.replace("_per_second", "/s").replace("_", " ")],
                [[name, statistics.median(rates[name])] for name in ROWS]))
    report = Ratios()
    report.add(f"packed/padded {unit}", statistics.median(rates["packed"]), statistics.median(rates["padded"]),
               f"{options.objective} throughput of packed rows (block-causal) against padded rows",
               repeat_ratios(rates["packed"], rates["padded"]))
    write_json(options, __doc__, report, load_average, **{unit: rates})
    return 0


if __name__ == "__main__":
    sys.exit(main())
