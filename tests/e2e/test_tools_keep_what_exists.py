"""Nothing that exists is destroyed by a failed or careless command of the tools (issue 44, class 4).

A preprocessing rerun that fails on a bad record leaves the earlier output byte for byte and no temporary
file; a converter refuses an output folder holding a model or a run unless given --overwrite, and a failed
conversion leaves the folder as it was.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from megatron.checkpointing.ondisk import layout
from megatron.checkpointing.ondisk.module_weights import read_module_weights
from megatron.data import MMapIndexedDataset
from megatron.hf.convert import convert_hf_to_neox
from megatron.hf.output_folder import staged_output
from tests.e2e.test_hf_conversion import hf_reference, make_hf_model, save_hf
from tests.e2e.test_preprocess_chat import CHAT, make_chat_tokenizer, write_jsonl
from tests.e2e.test_preprocess_data import vocab_file  # noqa: F401  (a fixture)


def files_of(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (relative name -> bytes): what is there, temporaries included."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def stopped(main, *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(list(argv))
    message = str(exit_.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_failed_preprocess_data_rerun_leaves_the_earlier_output_as_it_was(tmp_path, vocab_file, workers):  # noqa: F811
    from tools.datasets.preprocess_data import main

    records = [{"text": f"line {i}: " + "word " * (i % 7)} for i in range(100)]
    good = write_jsonl(tmp_path / "good.jsonl", records)
    out = tmp_path / "out"
    flags = ("--output-prefix", str(out / "data"), "--tokenizer-type", "HFTokenizer", "--vocab-file", str(vocab_file),
             "--append-eod", "--workers", workers)
    main(["--input", good, *flags])
    before = files_of(out)
    assert set(before) == {"data_text_document.bin", "data_text_document.idx", "data_text_document.meta.json"}

    # the bad record comes after two chunks' worth of good ones: output had been written when it is met
    bad = write_jsonl(tmp_path / "bad.jsonl", [*records[:80], {"body": "no text"}, *records[80:]])
    assert f"{bad}:81 has no field 'text'" in stopped(main, "--input", bad, *flags)
    assert files_of(out) == before

    main(["--input", write_jsonl(tmp_path / "other.jsonl", records[:5]), *flags])  # a run that succeeds replaces
    assert set(files_of(out)) == set(before) and len(MMapIndexedDataset(out / "data_text_document")) == 5


def test_a_failed_chat_template_rerun_leaves_tokens_labels_and_rewards_as_they_were(tmp_path):
    from tools.datasets.preprocess_data_with_chat_template import main

    tokenizer = make_chat_tokenizer(tmp_path / "tok")
    records = [{"conversation": CHAT[: 3 + i % 3], "r": i} for i in range(60)]
    out = tmp_path / "out"
    flags = ("--output-prefix", str(out / "sft"), "--tokenizer-path", str(tokenizer), "--reward-key", "r")
    main(["--input", write_jsonl(tmp_path / "good.jsonl", records), *flags])
    before = files_of(out)
    assert len(before) == 7  # .bin and .idx of tokens, labels and rewards; the tokens' .meta.json

    bad = write_jsonl(tmp_path / "bad.jsonl", [*records[:50], {"conversation": CHAT, "r": "high"}])
    assert f"{bad}:51: reward field 'r'" in stopped(main, "--input", bad, *flags)
    assert files_of(out) == before


def a_run(tmp_path: Path) -> Path:
    """A run's save folder as training leaves it: two tags, `latest` naming the newer, and a file of the user's."""
    run = tmp_path / "run"
    convert_hf_to_neox(save_hf(make_hf_model("llama_gqa"), tmp_path / "base", tokenizer=True), run)
    (run / "global_step0").rename(run / "global_step100")
    shutil.copytree(run / "global_step100", run / "global_step200")
    layout.write_latest(run, "global_step200")
    (run / "notes.txt").write_text("lr 3e-4 diverged at 150")
    return run


def convert(capsys, name: str, *argv: str | Path) -> tuple[int, str]:
    """Run tools/ckpts/<name>.py's main: (exit status, its stderr)."""
    from importlib import import_module

    capsys.readouterr()  # what came before, e.g. transformers' progress bars
    status = import_module(f"tools.ckpts.{name}").main([str(arg) for arg in argv])
    return status, capsys.readouterr().err.strip()


def one_line_error(status: int, err: str) -> str:
    assert status == 1 and err.startswith("error: ") and "\n" not in err
    return err


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def siblings(folder: Path) -> list[str]:
    """What lies beside `folder`: a conversion's temporary folder would show here."""
    return sorted(p.name for p in folder.parent.iterdir())


def test_convert_hf_to_neox_refuses_a_run_s_save_folder_unless_told_to_replace_it(tmp_path, capsys):
    run = a_run(tmp_path)
    model = make_hf_model("neox_parallel", seed=1)
    hf_dir = save_hf(model, tmp_path / "hf", tokenizer=True)
    config_out = tmp_path / "model.yml"
    config_out.write_text("# the user's\n")
    before, beside = files_of(run), siblings(run)

    err = one_line_error(*convert(capsys, "convert_hf_to_neox", "--input", hf_dir, "--output", run))
    assert f"--output {run} already holds a model or a run (global_step100, global_step200, latest, tokenizer.json)" in err
    assert "pass --overwrite" in err
    assert files_of(run) == before and siblings(run) == beside  # `latest` still names the run's own tag

    err = one_line_error(*convert(capsys, "convert_hf_to_neox", "--input", hf_dir, "--output", tmp_path / "new",
                                  "--config-out", config_out))
    assert f"--config-out {config_out} exists" in err
    assert config_out.read_text() == "# the user's\n" and not (tmp_path / "new").exists()

    # --overwrite replaces the run as a whole: no tag of it is left beside the converted one
    assert convert(capsys, "convert_hf_to_neox", "--input", hf_dir, "--output", run, "--overwrite")[0] == 0
    assert sorted(files_of(run)) == ["global_step0/manifest.json", "global_step0/mp_rank_00_model_states.pt", "latest",
                                     "notes.txt", "tokenizer.json"]
    assert (run / "latest").read_text() == "global_step0" and (run / "notes.txt").read_bytes() == before["notes.txt"]
    converted = read_module_weights(run / "global_step0")
    assert torch.equal(converted["sequential.0.word_embeddings.weight"],
                       hf_reference(model)["gpt_neox.embed_in.weight"])
    assert siblings(run) == beside


def test_convert_neox_to_hf_refuses_a_model_folder_and_replaces_all_of_it_with_overwrite(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    export = save_hf(make_hf_model("neox_sequential_tied"), tmp_path / "export", "sharded")  # an earlier export
    model = make_hf_model("neox_parallel", seed=2)
    convert_hf_to_neox(save_hf(model, tmp_path / "hf"), tmp_path / "ckpt")
    before, beside = files_of(export), siblings(export)

    err = one_line_error(*convert(capsys, "convert_neox_to_hf", "--input", tmp_path / "ckpt", "--output_dir", export))
    assert f"--output {export} already holds a model or a run (config.json, generation_config.json, model-00001-of-" in err
    assert files_of(export) == before and siblings(export) == beside

    # the earlier export's shards and index go too: left beside the new model.safetensors, the index would
    # make transformers load the old weights
    assert convert(capsys, "convert_neox_to_hf", "--input", tmp_path / "ckpt", "--output_dir", export, "--overwrite")[0] == 0
    assert sorted(files_of(export)) == ["config.json", "model.safetensors"]
    reloaded = AutoModelForCausalLM.from_pretrained(export).state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(reloaded[name], tensor), name
    assert siblings(export) == beside


@pytest.mark.parametrize("output", ["ckpt", "ckpt/global_step0", "."])
def test_a_converter_never_writes_over_its_input_even_with_overwrite(tmp_path, capsys, output):
    convert_hf_to_neox(save_hf(make_hf_model("neox_parallel"), tmp_path / "hf"), tmp_path / "ckpt")
    before = files_of(tmp_path)
    out = tmp_path / output
    err = one_line_error(*convert(capsys, "convert_neox_to_hf", "--input", tmp_path / "ckpt", "--output", out,
                                  "--overwrite"))
    assert f"--output {out} is, holds or lies in the input {tmp_path / 'ckpt'}" in err
    assert files_of(tmp_path) == before


def test_a_new_output_folder_is_made_like_any_folder_and_one_under_a_file_is_one_line(tmp_path, capsys):
    hf_dir = save_hf(make_hf_model("neox_parallel"), tmp_path / "hf")
    assert convert(capsys, "convert_hf_to_neox", "--input", hf_dir, "--output", tmp_path / "new")[0] == 0
    assert (tmp_path / "new").stat().st_mode & 0o777 == 0o777 & ~current_umask()  # readable as any folder
    (tmp_path / "a_file").write_text("not a folder")
    err = one_line_error(*convert(capsys, "convert_hf_to_neox", "--input", hf_dir, "--output", tmp_path / "a_file" / "x"))
    assert f"{tmp_path / 'a_file'} is a file, not a folder" in err


def test_a_conversion_that_fails_while_writing_leaves_the_output_folder_as_it_was(tmp_path):
    run = a_run(tmp_path)
    before, beside = files_of(run), siblings(run)
    with pytest.raises(OSError), staged_output(run) as staging:
        layout.write_latest(staging, "global_step0")
        (staging / "global_step0").mkdir()
        raise OSError(28, "No space left on device")
    assert files_of(run) == before and siblings(run) == beside
