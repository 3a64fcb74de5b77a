"""text_gen_type precompute: the reference model's log-probabilities of every document of the preference
data, written where `precompute_model_name` makes DPO and KTO read them instead of running a live reference.

As GPT-NeoX writes them (generate.py with `text_gen_type: precompute`, `load` naming the reference): for each
data prefix (dataset_impl pairwise: every pos_/neg_{train,valid,test}_data_paths entry, else every
{train,valid,test}_data_paths entry) the file `{prefix}_{precompute_model_name}.bin/.idx`, float32, one
document per document of the prefix, seq_length long: entry j is log p(token j+1 | tokens 0..j) of the
document cut or padded (with 0) to seq_length + 1 tokens. Files that exist are kept. Every rank computes;
global rank 0 writes, into temporary names renamed when complete.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

SPLITS = ("train", "valid", "test")


def data_prefixes(args) -> list[str]:
    """The data prefixes whose documents get reference log-probabilities, each once."""
    sides = ("pos_", "neg_") if args.dataset_impl == "pairwise" else ("",)
    prefixes = [path for split in SPLITS for side in sides for path in getattr(args, f"{side}{split}_data_paths") or ()]
    return list(dict.fromkeys(prefixes))


def _documents(data, seq_length: int, start: int, stop: int) -> torch.Tensor:
    rows = torch.zeros(stop - start, seq_length + 1, dtype=torch.long)
    for row, index in enumerate(range(start, stop)):
        tokens = np.asarray(data[index][: seq_length + 1], dtype=np.int64)
        rows[row, : len(tokens)] = torch.from_numpy(tokens)
    return rows


@torch.no_grad()
def write_reference_log_probs(model, args, rank: int, log) -> list[str]:
    """Write the missing `{prefix}_{precompute_model_name}` files; the prefixes written."""
    from megatron.data import MMapIndexedDataset, MMapIndexedDatasetBuilder
    from megatron.data.builders import reference_log_probs_prefix
    from megatron.data.indexed_dataset import data_file_path, index_file_path
    from megatron.initialize import current_device
    from megatron.model import token_log_probs

    written = []
    batch_size = args.train_micro_batch_size_per_gpu or 1
    for prefix in data_prefixes(args):
        target = reference_log_probs_prefix(prefix, args.precompute_model_name)
        if Path(data_file_path(target)).is_file() and Path(index_file_path(target)).is_file():
            log.info(f"precompute: {target} exists, kept")
            continue
        data = MMapIndexedDataset(prefix, setting="precompute")
        partial = f"{target}.partial"
        builder = MMapIndexedDatasetBuilder(data_file_path(partial), dtype=np.float32) if rank == 0 else None
        for start in range(0, len(data), batch_size):
            text = _documents(data, args.seq_length, start, min(start + batch_size, len(data))).to(current_device())
            logits = model(text[:, :-1], parallel_output=True)
            log_probs = token_log_probs(logits, text[:, 1:], vocab_parallel=True, fp32=True).cpu()
            if builder is not None:
                for row in log_probs:
                    builder.add_item(row.numpy())
                    builder.end_document()
        if builder is not None:
            builder.finalize(index_file_path(partial))
            os.replace(data_file_path(partial), data_file_path(target))
            os.replace(index_file_path(partial), index_file_path(target))
        log.info(f"precompute: wrote {target} ({len(data)} documents x {args.seq_length} log-probabilities)")
        written.append(target)
    return written
