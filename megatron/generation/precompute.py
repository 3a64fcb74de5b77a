"""text_gen_type precompute: the reference model's log-probabilities of every document of the preference
data, written where `precompute_model_name` makes DPO and KTO read them instead of running a live reference.

As GPT-NeoX writes them (generate.py with `text_gen_type: precompute`, `load` naming the reference): for each
data prefix (dataset_impl pairwise: every pos_/neg_{train,valid,test}_data_paths entry, else every
{train,valid,test}_data_paths entry) the file `{prefix}_{precompute_model_name}.bin/.idx`, float32, one
document per document of the prefix, seq_length long: entry j is log p(token j+1 | tokens 0..j) of the
document cut or padded (with 0) to seq_length + 1 tokens, and beside it `{prefix}_{precompute_model_name}.reference.json`,
the identity of the model (megatron/objectives/precomputed_reference.py). Files the same model wrote are kept;
files another model wrote are refused unless precompute_overwrite is set. Every rank computes; global rank 0
writes, into temporary names renamed when complete, the identity last.
"""

from __future__ import annotations

import os

import numpy as np
import torch


def _documents(data, seq_length: int, start: int, stop: int) -> torch.Tensor:
    rows = torch.zeros(stop - start, seq_length + 1, dtype=torch.long)
    for row, index in enumerate(range(start, stop)):
        tokens = np.asarray(data[index][: seq_length + 1], dtype=np.int64)
        rows[row, : len(tokens)] = torch.from_numpy(tokens)
    return rows


@torch.no_grad()
def write_reference_log_probs(model, settings, identity, rank: int, log) -> list[str]:
    """Write the `{prefix}_{precompute_model_name}` files `model` (whose weights `identity` names, recorded beside
    each file) has to write (precomputed_reference.files_to_write decides which, from `settings`, a
    PrecomputeSettings); the prefixes written."""
    from megatron.data import MMapIndexedDataset, MMapIndexedDatasetBuilder
    from megatron.data.indexed_dataset import data_file_path, index_file_path
    from megatron.model import token_log_probs
    from megatron.objectives.precomputed_reference import files_to_write, record_path, write_identity
    from megatron.runtime.initialize import current_device

    written = []
    batch_size = settings.train_micro_batch_size_per_gpu or 1
    for prefix, target in files_to_write(settings, identity, log).items():
        data = MMapIndexedDataset(prefix, setting="precompute")
        partial = f"{target}.partial"
        builder = MMapIndexedDatasetBuilder(data_file_path(partial), dtype=np.float32) if rank == 0 else None
        for start in range(0, len(data), batch_size):
            text = _documents(data, settings.seq_length, start, min(start + batch_size, len(data))).to(current_device())
            logits = model(text[:, :-1], parallel_output=True)
            log_probs = token_log_probs(logits, text[:, 1:], vocab_parallel=True, fp32=True).cpu()
            if builder is not None:
                for row in log_probs:
                    builder.add_item(row.numpy())
                    builder.end_document()
        if builder is not None:
            builder.finalize(index_file_path(partial))
            record_path(target).unlink(missing_ok=True)  # replaced files never stand beside the old model's record
            os.replace(data_file_path(partial), data_file_path(target))
            os.replace(index_file_path(partial), index_file_path(target))
            write_identity(target, identity)
        log.info(f"precompute: wrote {target} ({len(data)} documents x {settings.seq_length} log-probabilities) from "
                 f"{identity.path}")
        written.append(target)
    return written
