"""Checkpoint layout: tag names, `latest`, tag listing, configs copy, keep_last_n pruning."""

from __future__ import annotations

import pytest

from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.ondisk import layout


def make_tags(root, iterations):
    for iteration in iterations:
        tag_dir = root / f"global_step{iteration}"
        tag_dir.mkdir(parents=True)
        (tag_dir / "mp_rank_00_model_states.pt").write_bytes(b"x")


def test_tag_names_round_trip():
    assert layout.tag_for_iteration(1200) == "global_step1200"
    assert layout.iteration_of_tag("global_step1200") == 1200
    assert layout.iteration_of_tag("best") is None
    assert layout.iteration_of_tag("global_step12a") is None


def test_file_name_patterns_match_what_they_name():
    assert layout.MODEL_STATES_RE.match(layout.model_states_name(0))
    assert layout.model_states_name(3) == "mp_rank_03_model_states.pt"
    assert layout.ZERO3_MODEL_STATES_RE.match(layout.zero3_model_states_name(12, 1)).groups() == ("12", "01")
    assert layout.optim_states_name(2, 0, "bf16") == "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt"
    assert layout.OPTIM_STATES_RE.match(layout.optim_states_name(2, 0, "bf16")).groups() == ("bf16", "2", "00")
    assert layout.OPTIM_STATES_RE.match(layout.optim_states_name(5, 1)).groups() == (None, "5", "01")
    assert layout.layer_file_name(7, 0) == "layer_07-model_00-model_states.pt"
    assert layout.LAYER_FILE_RE.match("layer_07-model_00-model_states.pt").groups() == ("07", "00")
    # a ZeRO-3 model-states file is not an mp_rank model-states file
    assert not layout.MODEL_STATES_RE.match(layout.zero3_model_states_name(0, 0))


def test_latest_written_atomically_and_read_back(tmp_path):
    assert layout.read_latest(tmp_path) is None
    layout.write_latest(tmp_path, "global_step5")
    layout.write_latest(tmp_path, "global_step10")
    assert layout.read_latest(tmp_path) == "global_step10"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]


def test_empty_latest_is_an_error_naming_the_file(tmp_path):
    (tmp_path / "latest").write_text("\n")
    with pytest.raises(CheckpointError, match=str(tmp_path / "latest")):
        layout.read_latest(tmp_path)


def test_list_tags_sorted_by_iteration_ignores_other_entries(tmp_path):
    make_tags(tmp_path, [100, 20, 3])
    (tmp_path / "global_step7").write_text("a file, not a tag")
    (tmp_path / "tensorboard").mkdir()
    assert layout.list_tags(tmp_path) == {"global_step3": 3, "global_step20": 20, "global_step100": 100}
    assert layout.list_tags(tmp_path / "missing") == {}


def test_copy_configs_writes_each_yaml(tmp_path):
    texts = {"tiny.yml": "num_layers: 2\n", "local_setup.yml": "save: ckpts\n"}
    written = layout.copy_configs(texts, tmp_path / "global_step1")
    assert sorted(p.name for p in written) == ["local_setup.yml", "tiny.yml"]
    for name, text in texts.items():
        assert (tmp_path / "global_step1" / "configs" / name).read_text() == text
    assert layout.copy_configs(None, tmp_path / "global_step2") == []


def all_tags(root):
    return set(layout.list_tags(root))


def test_prune_keeps_newest_n(tmp_path):
    make_tags(tmp_path, [1, 2, 3, 4, 5])
    layout.write_latest(tmp_path, "global_step5")
    deleted = layout.prune_checkpoints(tmp_path, 2, all_tags(tmp_path))
    assert deleted == ["global_step1", "global_step2", "global_step3"]
    assert list(layout.list_tags(tmp_path)) == ["global_step4", "global_step5"]


def test_prune_never_deletes_the_tag_latest_names(tmp_path):
    make_tags(tmp_path, [1, 2, 3])
    layout.write_latest(tmp_path, "global_step1")  # e.g. someone pointed latest back at an old tag
    deleted = layout.prune_checkpoints(tmp_path, 1, all_tags(tmp_path))
    assert deleted == ["global_step2"]
    assert list(layout.list_tags(tmp_path)) == ["global_step1", "global_step3"]


def test_prune_deletes_only_lineage_tags_and_never_protected_ones(tmp_path):
    # a run that loaded global_step20 and saved 21, 22, 23; 30 and 40 are from before the rollback
    make_tags(tmp_path, [10, 20, 21, 22, 23, 30, 40])
    layout.write_latest(tmp_path, "global_step23")
    lineage = {"global_step10", "global_step20", "global_step21", "global_step22", "global_step23"}
    deleted = layout.prune_checkpoints(tmp_path, 2, lineage, protected=["global_step20"])
    assert deleted == ["global_step10", "global_step21"]
    assert list(layout.list_tags(tmp_path)) == ["global_step20", "global_step22", "global_step23",
                                                "global_step30", "global_step40"]


def test_prune_unset_keeps_everything_and_zero_is_refused(tmp_path):
    make_tags(tmp_path, [1, 2])
    assert layout.prune_checkpoints(tmp_path, None, all_tags(tmp_path)) == []
    with pytest.raises(CheckpointError, match="keep_last_n_checkpoints"):
        layout.prune_checkpoints(tmp_path, 0, all_tags(tmp_path))
    assert len(layout.list_tags(tmp_path)) == 2


def test_partial_tags_are_not_tags(tmp_path):
    make_tags(tmp_path, [1])
    (tmp_path / layout.partial_tag("global_step2")).mkdir()
    assert list(layout.list_tags(tmp_path)) == ["global_step1"]
    assert layout.list_partial_tags(tmp_path) == ["global_step2.partial"]


@pytest.mark.parametrize("content, expected", [
    (b"\x80\xff\xfe\x00binary", "holds binary data"),
    (b"../other/global_step24", "not a folder directly inside"),
    (b"/abs/global_step24", "not a folder directly inside"),
    (b"..", "not a folder directly inside"),
])
def test_latest_that_is_not_a_tag_name_is_one_clear_error(tmp_path, content, expected):
    (tmp_path / "latest").write_bytes(content)
    with pytest.raises(CheckpointError, match=expected) as raised:
        layout.read_latest(tmp_path)
    message = str(raised.value)
    assert str(tmp_path / "latest") in message and "\n" not in message and "iteration: N" in message


def test_unreadable_latest_is_one_clear_error(tmp_path):
    (tmp_path / "latest").mkdir()  # unreadable as a file, even for root
    with pytest.raises(CheckpointError, match=r"cannot read .*latest: Is a directory"):
        layout.read_latest(tmp_path)
