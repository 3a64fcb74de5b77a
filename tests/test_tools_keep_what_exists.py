"""Nothing that exists is destroyed by a failed or careless command of the tools (issue 44, class 4).

A preprocessing rerun that fails on a bad record leaves the earlier output byte for byte and no temporary
file; a converter refuses an output folder holding a model or a run unless given --overwrite, and a failed
conversion leaves the folder as it was.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron.data import MMapIndexedDataset
from tests.test_preprocess_chat import CHAT, make_chat_tokenizer, write_jsonl
from tests.test_preprocess_data import vocab_file  # noqa: F401  (a fixture)


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
