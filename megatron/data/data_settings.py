"""DataSettings: the run's settings the datasets, their checks and the data iterators read, taken from the whole
settings once (`from_args`) where a run builds its data (megatron.training.loop.setup, the dry run) and handed to
megatron/data/builders.py and data_vocabulary.py. Each field is the setting of the same name."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

Paths = list[str] | None


@dataclass(frozen=True)
class DataSettings:
    seq_length: int | None
    seed: int
    dataset_impl: str
    pack_impl: str
    allow_chopped: bool
    data_path: str | None
    split: str
    train_data_paths: Paths
    valid_data_paths: Paths
    test_data_paths: Paths
    train_data_weights: list[float] | None
    valid_data_weights: list[float] | None
    test_data_weights: list[float] | None
    train_label_data_paths: Paths
    valid_label_data_paths: Paths
    test_label_data_paths: Paths
    train_reward_data_paths: Paths
    valid_reward_data_paths: Paths
    test_reward_data_paths: Paths
    pos_train_data_paths: Paths
    pos_valid_data_paths: Paths
    pos_test_data_paths: Paths
    neg_train_data_paths: Paths
    neg_valid_data_paths: Paths
    neg_test_data_paths: Paths
    pos_train_label_data_paths: Paths
    pos_valid_label_data_paths: Paths
    pos_test_label_data_paths: Paths
    neg_train_label_data_paths: Paths
    neg_valid_label_data_paths: Paths
    neg_test_label_data_paths: Paths
    precompute_model_name: str | None
    tokenizer_type: str | None
    vocab_file: str | None
    padded_vocab_size: int | None
    train_micro_batch_size_per_gpu: int | None
    num_workers: int
    train_iters: int | None
    train_batch_size: int | None
    eval_interval: int | None
    eval_iters: int

    @classmethod
    def from_args(cls, args) -> DataSettings:
        return cls(**{field.name: getattr(args, field.name) for field in dataclasses.fields(cls)})
