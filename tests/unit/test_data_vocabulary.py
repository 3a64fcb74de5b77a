"""Data made with another tokenizer is refused before training, naming the dataset and the fix."""

from __future__ import annotations

import os

import numpy as np
import pytest

from megatron.data import DataError, MMapIndexedDatasetBuilder
from megatron.data.data_vocabulary import (
    check_data_vocabulary,
    read_vocabulary_record,
    write_vocabulary_record,
)
from megatron.data.indexed_dataset import data_file_path, index_file_path
from megatron.neox_arguments import NeoXArgs

MODEL = dict(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=8)


def write_dataset(prefix, documents, vocab_size=None, dtype=np.uint16):
    builder = MMapIndexedDatasetBuilder(data_file_path(prefix), dtype)
    for document in documents:
        builder.add_item(np.asarray(document))
        builder.end_document()
    builder.finalize(index_file_path(prefix))
    if vocab_size is not None:
        write_vocabulary_record(prefix, vocab_size, builder.max_token_id, "HFTokenizer")
    return str(prefix)


def args_for(padded_vocab_size, **data):
    return NeoXArgs.from_dict({**MODEL, "tokenizer_type": "HFTokenizer", "vocab_file": "tok.json",
                               "padded_vocab_size": padded_vocab_size, **data})


def test_builder_tracks_the_largest_id_and_the_record_holds_it(tmp_path):
    prefix = write_dataset(tmp_path / "d", [[5, 300, 7], [299]], vocab_size=320)
    assert read_vocabulary_record(prefix) == {"vocab_size": 320, "max_token_id": 300}


def test_data_of_another_tokenizer_names_both_vocabulary_sizes(tmp_path):
    prefix = write_dataset(tmp_path / "d", [[5, 100]], vocab_size=320)
    with pytest.raises(DataError) as error:
        check_data_vocabulary(args_for(384, data_path=prefix), tokenizer_vocab_size=293)
    message = str(error.value)
    assert message.startswith(f"data_path: dataset {prefix} was made with a tokenizer of 320 tokens (d.meta.json), "
                              "but the tokenizer (HFTokenizer, vocab_file tok.json) has 293")
    assert "preprocess_data.py" in message and "\n" not in message
    check_data_vocabulary(args_for(384, data_path=prefix), tokenizer_vocab_size=320)


def test_ids_beyond_the_padded_vocabulary_are_refused_before_training(tmp_path):
    """Without a record (GPT-NeoX's data): the largest id, computed once and cached next to the data."""
    prefix = write_dataset(tmp_path / "d", [[1, 2], [3, 400, 390], [9]])
    with pytest.raises(DataError, match=rf"^data_path: dataset {prefix} holds token id 400 \(document 1, position 1\), "
                                        r"but the model has 384 vocabulary rows \(the tokenizer .* has 293 tokens"):
        check_data_vocabulary(args_for(384, data_path=prefix), tokenizer_vocab_size=293)
    cached = list(tmp_path.glob("d_token_id_range_*"))
    assert cached, "the largest id was not cached next to the data"
    check_data_vocabulary(args_for(512, data_path=prefix), tokenizer_vocab_size=500)
    assert sorted(tmp_path.glob("d_token_id_range_*")) == sorted(cached)  # read back, not rebuilt


@pytest.mark.parametrize("setting", ["train_label_data_paths", "valid_label_data_paths", "pos_train_label_data_paths",
                                     "neg_test_label_data_paths"])
def test_label_ids_past_the_vocabulary_are_refused_naming_the_file_document_and_position(tmp_path, setting):
    """Negative labels are masked and pass; a label the model has no row for is refused at setup, in one line, where
    the run would end mid-way in `IndexError: Target 99999 is out of bounds`."""
    data_setting = setting.replace("label_", "")
    tokens = write_dataset(tmp_path / "d", [[1, 2, 3], [4, 5, 6]], vocab_size=293)
    good = write_dataset(tmp_path / "good_label", [[-100, 2, 3], [-100, -100, 6]], dtype=np.int32)
    bad = write_dataset(tmp_path / "bad_label", [[-100, 2, 3], [-100, 99999, 384]], dtype=np.int32)
    check_data_vocabulary(args_for(384, **{data_setting: [tokens, tokens], setting: [good, good]}), 293)
    with pytest.raises(DataError) as error:
        check_data_vocabulary(args_for(384, **{data_setting: [tokens, tokens], setting: [good, bad]}), 293)
    message = str(error.value)
    assert message.startswith(f"{setting}[1]: label file {bad} holds label id 99999 (document 1, position 1), but the "
                              "model has 384 vocabulary rows (the tokenizer (HFTokenizer, vocab_file tok.json) has 293 ")
    assert "negative where the loss is masked" in message and "\n" not in message


@pytest.mark.parametrize("setting", ["data_path", "train_data_paths", "neg_valid_data_paths"])
def test_a_negative_token_id_in_a_signed_token_file_is_refused_naming_the_file_document_and_position(tmp_path,
                                                                                                       setting):
    """A label may be negative (masked); a token id may not: the embedding would read a row from the end."""
    prefix = write_dataset(tmp_path / "d", [[1, 2, 3], [4, -7, 6, -1]], dtype=np.int32)
    value = prefix if setting == "data_path" else [prefix]
    with pytest.raises(DataError) as error:
        check_data_vocabulary(args_for(384, **{setting: value}), 293)
    where = setting if setting == "data_path" else f"{setting}[0]"
    message = str(error.value)
    assert message.startswith(f"{where}: dataset {prefix} holds token id -7 (document 1, position 1); ")
    assert "never negative" in message and "preprocess_data.py" in message and "\n" not in message
    cached = sorted(tmp_path.glob("d_token_id_range_*"))
    assert cached  # the scan is kept: once per file
    with pytest.raises(DataError):
        check_data_vocabulary(args_for(384, **{setting: value}), 293)
    assert sorted(tmp_path.glob("d_token_id_range_*")) == cached


def test_the_largest_id_is_read_once_per_file_not_per_check(tmp_path):
    """The scan of the .bin is cached next to the data: a second check (the next run, another rank) reads the cache."""
    tokens = write_dataset(tmp_path / "d", [[1, 2, 3]], vocab_size=293)
    labels = write_dataset(tmp_path / "l", [[-100, 2, 3]], dtype=np.int32)
    args = args_for(384, train_data_paths=[tokens], train_label_data_paths=[labels])
    check_data_vocabulary(args, 293)
    cached = sorted(tmp_path.glob("l_token_id_range_*"))
    assert cached
    check_data_vocabulary(args, 293)
    assert sorted(tmp_path.glob("l_token_id_range_*")) == cached


def test_every_dataset_of_every_split_is_checked(tmp_path):
    good = write_dataset(tmp_path / "good", [[1, 2, 3]], vocab_size=293)
    bad = write_dataset(tmp_path / "bad", [[1, 2, 3]], vocab_size=50277)
    args = args_for(384, train_data_paths=[good], valid_data_paths=[good], test_data_paths=[good, bad])
    with pytest.raises(DataError, match=rf"^test_data_paths\[1\]: dataset {bad} was made with a tokenizer of 50277"):
        check_data_vocabulary(args, tokenizer_vocab_size=293)


def test_a_record_of_other_files_is_not_believed(tmp_path):
    prefix = write_dataset(tmp_path / "d", [[1, 2]], vocab_size=50277)
    write_dataset(tmp_path / "d", [[1, 2, 3, 4]])  # the data rebuilt, the old record left behind
    assert read_vocabulary_record(prefix) is None
    check_data_vocabulary(args_for(384, data_path=prefix), tokenizer_vocab_size=293)


def test_a_record_left_by_same_sized_data_is_stale_and_the_ids_are_read_from_the_bin(tmp_path):
    """The .bin rewritten with as many tokens: the sizes match the old record, the modification time does not."""
    prefix = write_dataset(tmp_path / "d", [[1, 2], [3]], vocab_size=293)
    record = read_vocabulary_record(prefix)
    write_dataset(tmp_path / "d", [[1, 400], [3]])  # same sizes, ids of a larger vocabulary
    later = os.stat(data_file_path(prefix)).st_mtime_ns + 10**9  # a rewrite in the same clock tick as the first write
    os.utime(data_file_path(prefix), ns=(later, later))
    assert record is not None and read_vocabulary_record(prefix) is None
    with pytest.raises(DataError, match=rf"^data_path: dataset {prefix} holds token id 400 \(document 0, position 1\), "
                                        r"but the model has 384"):
        check_data_vocabulary(args_for(384, data_path=prefix), tokenizer_vocab_size=293)


@pytest.mark.parametrize("documents", [[], [[], []]], ids=["no documents", "empty documents"])
def test_an_empty_dataset_is_refused_naming_it_and_the_fix(tmp_path, documents):
    good = write_dataset(tmp_path / "good", [[1, 2, 3]], vocab_size=293)
    empty = write_dataset(tmp_path / "empty", documents, vocab_size=293)
    args = args_for(384, train_data_paths=[good], valid_data_paths=[empty], test_data_paths=[good])
    with pytest.raises(DataError) as error:
        check_data_vocabulary(args, tokenizer_vocab_size=293)
    assert str(error.value) == (
        f"valid_data_paths[0]: dataset {empty} holds no tokens ({len(documents)} documents in {empty}.idx); "
        "re-run tools/datasets/preprocess_data.py on input with text, or remove it from the run's data")


def test_a_split_that_gives_training_no_documents_is_refused_before_the_first_step(tmp_path):
    from megatron.data import build_train_valid_test_datasets

    prefix = write_dataset(tmp_path / "d", [[1] * 20] * 3, vocab_size=293)
    args = args_for(384, data_path=prefix, split="1, 1000, 0")
    with pytest.raises(DataError, match=rf"^data_path: split '1, 1000, 0' gives the train split none of the 3 "
                                        rf"documents of {prefix}; give it a larger share"):
        build_train_valid_test_datasets(args, (4, 4, 0))


def test_a_training_run_stops_at_setup_not_mid_run_with_an_index_error(single_rank_world, tmp_path):
    from megatron.launch.run_context import resolve_run_settings
    from megatron.tokenizer import train_bpe_tokenizer
    from megatron.training.loop import setup

    vocab_file = train_bpe_tokenizer(["def f(x):\n    return x * x\n"] * 50, tmp_path / "tok.json", vocab_size=300)
    prefix = write_dataset(tmp_path / "other", [list(range(0, 1000, 7))] * 8)  # made with a larger vocabulary
    args = resolve_run_settings(NeoXArgs.from_dict(
        {**MODEL, "train_iters": 2, "lr": 1e-3, "train_micro_batch_size_per_gpu": 1, "data_path": prefix,
         "tokenizer_type": "HFTokenizer", "vocab_file": str(vocab_file)}, require_run_settings=True))
    with pytest.raises(DataError, match=rf"^data_path: dataset {prefix} holds token id 385 \(document 0, position 55\), "
                                        r"but the model has 384 vocabulary rows"):
        setup(args)


def test_start_up_checks_each_data_file_once(single_rank_world, tmp_path, monkeypatch):
    """check_data_files (the dry run's) and the datasets' constructors make the same checks; start-up makes them
    once, as it builds the datasets, not once more before."""
    from megatron.data import builders, gpt_dataset
    from megatron.launch.run_context import resolve_run_settings
    from megatron.tokenizer import train_bpe_tokenizer
    from megatron.training.loop import setup

    checked, check = [], gpt_dataset.check_gpt_files

    def counted(name, data, *rest, **settings):
        checked.append((name, data.prefix))
        return check(name, data, *rest, **settings)

    monkeypatch.setattr(gpt_dataset, "check_gpt_files", counted)
    monkeypatch.setattr(builders, "check_gpt_files", counted)
    vocab_file = train_bpe_tokenizer(["def f(x):\n    return x * x\n"] * 50, tmp_path / "tok.json", vocab_size=300)
    prefix = write_dataset(tmp_path / "d", [list(range(1, 40))] * 8)
    args = resolve_run_settings(NeoXArgs.from_dict(
        {**MODEL, "train_iters": 2, "lr": 1e-3, "train_micro_batch_size_per_gpu": 1, "train_data_paths": [prefix],
         "valid_data_paths": [prefix], "eval_iters": 1, "tokenizer_type": "HFTokenizer",
         "vocab_file": str(vocab_file)}, require_run_settings=True))
    setup(args)
    assert checked == [("train", prefix), ("valid", prefix)]
