"""tools/datasets/preprocess_data_with_chat_template.py: chats in, GPT-NeoX token/label/reward .bin/.idx out.

The tokenizer is a tiny WordLevel model with a Jinja chat template in tokenizer_config.json; expected
tokens come from encoding the rendered text by hand, expected labels from reading GPT-NeoX's rules.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from megatron.data import MMapIndexedDataset
from tests.conftest import REPO_ROOT

TOOL = str(REPO_ROOT / "tools/datasets/preprocess_data_with_chat_template.py")
SPECIAL = ["<|pad|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<unk>"]
WORDS = "be kind hi hello there bye ok what is two plus four".split()
TEMPLATE = ("{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
            "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}<|{{ m['role'] }}|> {{ m['content'] }} "
            "<|end|> {% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}")
CHAT = [{"role": "system", "content": "be kind"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello there"}, {"role": "user", "content": "what is two plus two"},
        {"role": "assistant", "content": "four"}]
M = -100


def make_chat_tokenizer(folder, eos: str = "<|eos|>"):
    """A Hugging Face tokenizer folder: WordLevel over SPECIAL + WORDS (+ eos), TEMPLATE in tokenizer_config.json."""
    from transformers import PreTrainedTokenizerFast

    vocab = SPECIAL + WORDS + ([eos] if eos not in SPECIAL else [])
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(SPECIAL + [eos])
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token="<|pad|>",
                            unk_token="<unk>").save_pretrained(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    return folder


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return make_chat_tokenizer(tmp_path_factory.mktemp("chat_tokenizer"))


def ids(text: str) -> list[int]:
    vocab = {t: i for i, t in enumerate(SPECIAL + WORDS)}
    return [vocab[w] for w in text.split()]


EOS = ids("<|eos|>")[0]
SYSTEM, USER1 = ids("<|system|> be kind <|end|>"), ids("<|user|> hi <|end|> <|assistant|>")
ANSWER1, USER2 = ids("hello there <|end|>"), ids("<|user|> what is two plus two <|end|> <|assistant|>")
ANSWER2 = ids("four <|end|>")


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def run(*args: str) -> None:
    from tools.datasets.preprocess_data_with_chat_template import main

    main(list(args))


def read(prefix) -> list[list]:
    data = MMapIndexedDataset(prefix)
    return [data[i].tolist() for i in range(len(data))]


def test_labels_train_the_assistant_turns_by_default_and_the_last_with_only_last(tmp_path, tokenizer_dir):
    source = write_jsonl(tmp_path / "chats.jsonl", [{"messages": CHAT, "score": 0.75},
                                                    {"messages": CHAT[:3], "score": -2}])
    out = tmp_path / "out" / "sft"
    run("--input", source, "--tokenizer-path", str(tokenizer_dir), "--jsonl-keys", "messages",
        "--output-prefix", str(out), "--reward-key", "score")
    tokens = SYSTEM + USER1 + ANSWER1 + USER2 + ANSWER2 + [EOS]
    assert read(f"{out}_messages_document") == [tokens, SYSTEM + USER1 + ANSWER1 + [EOS]]
    labels = read(f"{out}_messages_label_document")
    assert labels[0] == ([M] * len(SYSTEM + USER1) + ANSWER1 + [M] * len(USER2) + ANSWER2 + [EOS])
    assert labels[1] == [M] * len(SYSTEM + USER1) + ANSWER1 + [EOS]
    assert MMapIndexedDataset(f"{out}_messages_label_document").dtype == np.int32
    rewards = MMapIndexedDataset(f"{out}_messages_reward_document")
    assert rewards.dtype == np.float32 and [r.tolist() for r in rewards] == [[0.75], [-2.0]]  # not truncated
    record = json.loads((tmp_path / "out" / "sft_messages_document.meta.json").read_text())
    assert record["vocab_size"] == len(SPECIAL + WORDS)

    run("--input", source, "--tokenizer-path", str(tokenizer_dir), "--jsonl-keys", "messages",
        "--output-prefix", str(out), "--only-last", "--reward-key", "score", "--binary-reward")
    assert read(f"{out}_messages_label_document")[0] == [M] * (len(tokens) - 3) + ANSWER2 + [EOS]
    # as in GPT-NeoX, --only-last trains the last turn only when it is the generation role's
    run("--input", write_jsonl(tmp_path / "user_last.jsonl", [{"messages": CHAT[:4]}]), "--tokenizer-path",
        str(tokenizer_dir), "--jsonl-keys", "messages", "--output-prefix", str(tmp_path / "u"), "--only-last")
    assert set(read(tmp_path / "u_messages_label_document")[0]) == {M}
    rewards = MMapIndexedDataset(f"{out}_messages_reward_document")
    assert rewards.dtype == np.int32 and [r.tolist() for r in rewards] == [[1], [-1]]  # -2 is not +1


def test_a_masked_last_turn_masks_the_eos_and_no_mask_trains_every_token(tmp_path, tokenizer_dir):
    ends_with_user = CHAT[:4]
    source = write_jsonl(tmp_path / "chats.jsonl", [{"conversation": ends_with_user}])
    run("--input", source, "--tokenizer-path", str(tokenizer_dir), "--output-prefix", str(tmp_path / "a"))
    last_user = ids("<|user|> what is two plus two <|end|>")
    plain = SYSTEM + USER1 + ANSWER1 + last_user
    assert read(tmp_path / "a_conversation_document") == [plain + [EOS]]
    assert read(tmp_path / "a_conversation_label_document") == [[M] * len(SYSTEM + USER1) + ANSWER1
                                                                 + [M] * (len(last_user) + 1)]

    run("--input", source, "--tokenizer-path", str(tokenizer_dir), "--output-prefix", str(tmp_path / "b"), "--no-mask")
    assert read(tmp_path / "b_conversation_document") == [plain]
    assert read(tmp_path / "b_conversation_label_document") == [plain]

    run("--input", source, "--tokenizer-path", str(tokenizer_dir), "--output-prefix", str(tmp_path / "c"), "--for-rm")
    assert read(tmp_path / "c_conversation_document") == [plain + [EOS, EOS]]
    assert read(tmp_path / "c_conversation_label_document") == [[M] * (len(plain) + 1) + [EOS]]


def test_command_line_with_workers_keeps_order(tmp_path, tokenizer_dir):
    chats = [{"conversation": CHAT[: 3 + (i % 3)]} for i in range(60)]
    source = write_jsonl(tmp_path / "chats.jsonl", chats)
    result = subprocess.run([sys.executable, TOOL, "--input", source, "--tokenizer-path", str(tokenizer_dir),
                             "--output-prefix", str(tmp_path / "w"), "--workers", "2", "--log-interval", "7",
                             "--num-docs", "60", "--ftfy", "--dataset-impl", "mmap"],
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    # the turn-by-turn tokens are those of the whole chat rendered at once
    rendered = ["".join(f"<|{m['role']}|> {m['content']} <|end|> " for m in chat["conversation"]) for chat in chats]
    expected = [ids(text) + [EOS] for text in rendered]
    assert read(tmp_path / "w_conversation_document") == expected
    assert "w_conversation_label_document" in result.stdout


@pytest.mark.parametrize("record, says", [
    ({"other": CHAT}, "has no field 'conversation'"),
    ({"conversation": []}, "an empty chat"),
    ({"conversation": [{"role": "tool", "content": "hi"}, {"role": "assistant", "content": "ok"}]},
     "the chat template rejects"),
    ({"conversation": CHAT, "r": "good"}, "not a number"),
])
def test_a_bad_record_is_one_line_with_file_and_line(tmp_path, tokenizer_dir, record, says):
    source = write_jsonl(tmp_path / "bad.jsonl", [{"conversation": CHAT, "r": 1}, record])
    with pytest.raises(SystemExit) as stopped:
        run("--input", source, "--tokenizer-path", str(tokenizer_dir), "--output-prefix", str(tmp_path / "x"),
            "--reward-key", "r")
    message = str(stopped.value)
    assert f"{source}:2" in message and says in message and "\n" not in message


def with_template(tokenizer_dir, folder, template: str):
    """A copy of the test tokenizer with another chat template."""
    import shutil

    shutil.copytree(tokenizer_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return folder


def refusal(tmp_path, tokenizer, source: str, *flags: str) -> str:
    """The one line the tool exits with; and it leaves no output behind."""
    with pytest.raises(SystemExit) as stopped:
        run("--input", source, "--tokenizer-path", str(tokenizer), "--output-prefix", str(tmp_path / "out" / "x"),
            *flags)
    message = str(stopped.value)
    assert message.startswith("preprocess_data_with_chat_template.py: error: ") and "\n" not in message
    assert not any((tmp_path / "out").iterdir())
    return message


# <|end|> closes only the chat's last message: the rendering of a chat's first turns is not the start of the
# whole chat's, so the tokens a turn adds are not those of its message
NOT_PREFIX_STABLE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% if loop.last %}<|end|> "
                     "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}")
# renders user and assistant messages only: any other role's message is dropped
TWO_ROLES = ("{% for m in messages %}{% if m['role'] in ['user', 'assistant'] %}<|{{ m['role'] }}|> {{ m['content'] }} "
             "<|end|> {% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}")
# renders every role by its name
ANY_ROLE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
            "{% if add_generation_prompt %}<|assistant|> {% endif %}")


def test_a_template_that_is_not_prefix_stable_is_refused_naming_the_record(tmp_path, tokenizer_dir):
    tokenizer = with_template(tokenizer_dir, tmp_path / "tok", NOT_PREFIX_STABLE)
    one_turn = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    source = write_jsonl(tmp_path / "chats.jsonl", [{"conversation": one_turn[1:]}, {"conversation": CHAT}])
    message = refusal(tmp_path, tokenizer, source)
    assert f"{source}:2: field 'conversation'" in message and "not prefix-stable" in message
    # the whole chat rendered at once is what --no-mask trains: nothing is cut out of it
    run("--input", source, "--tokenizer-path", str(tokenizer), "--output-prefix", str(tmp_path / "all"), "--no-mask")
    assert read(tmp_path / "all_conversation_document")[1][-1] == ids("<|end|>")[0]


@pytest.mark.parametrize("template, chat, says", [
    (TWO_ROLES, CHAT, "renders nothing for message 1 (role 'system'), a role it does not know"),
    (ANY_ROLE, [{"role": "human", "content": "hi"}, {"role": "gpt", "content": "hello"}],
     "has no 'assistant' message (its roles: human, gpt), so none of its tokens would be trained"),
])
def test_roles_the_template_or_the_generation_role_do_not_know_are_refused(tmp_path, tokenizer_dir, template, chat,
                                                                            says):
    tokenizer = with_template(tokenizer_dir, tmp_path / "tok", template)
    source = write_jsonl(tmp_path / "chats.jsonl", [{"conversation": CHAT[1:]}, {"conversation": chat}])
    message = refusal(tmp_path, tokenizer, source)
    assert f"{source}:2: field 'conversation'" in message and says in message


@pytest.mark.parametrize("message, says", [
    ({"role": "user", "content": 42}, "message 2 has the content 42, not a string"),
    ({"role": "user", "content": ["hi", "there"]}, "message 2 has the content [\"hi\", \"there\"], not a string"),
    ({"role": "user", "content": None}, "message 2 has the content null, not a string"),
    ({"role": 7, "content": "hi"}, "message 2 has the role 7, not a string"),
])
def test_a_message_whose_role_or_content_is_not_a_string_is_refused(tmp_path, tokenizer_dir, message, says):
    chat = [CHAT[0], message, CHAT[2]]
    source = write_jsonl(tmp_path / "chats.jsonl", [{"conversation": CHAT}, {"conversation": chat}])
    assert f"{source}:2: field 'conversation' {says}" in refusal(tmp_path, tokenizer_dir, source)


@pytest.mark.parametrize("line, says", [
    (b'{"conversation": [{"role": "user", "content": "caf\xe9"}]}', "is not UTF-8 text (byte 0xe9"),
    (b'{"conversation": [{"role": "user", "content": "hi \\ud800"}]}', "holds \\ud800, half of a UTF-16 surrogate pair"),
])
def test_text_that_is_not_unicode_is_one_line_naming_file_and_line(tmp_path, tokenizer_dir, line, says):
    source = tmp_path / "chats.jsonl"
    source.write_bytes(json.dumps({"conversation": CHAT}).encode() + b"\n" + line + b"\n")
    assert f"{source}:2 {says}" in refusal(tmp_path, tokenizer_dir, str(source))


def test_a_character_outside_the_bmp_written_as_a_surrogate_pair_is_text(tmp_path, tokenizer_dir):
    chat = [{"role": "user", "content": "hi \U0001f98a"}, {"role": "assistant", "content": "ok"}]
    source = write_jsonl(tmp_path / "chats.jsonl", [{"conversation": chat}])  # json.dumps writes \ud83e\udd8a
    assert "\\ud83e\\udd8a" in (tmp_path / "chats.jsonl").read_text()
    run("--input", source, "--tokenizer-path", str(tokenizer_dir), "--output-prefix", str(tmp_path / "o"))
    assert len(read(tmp_path / "o_conversation_document")) == 1


@pytest.mark.parametrize("prefix, says", [
    ("a_file/sft", "a_file is a file, not a folder"),
    ("a_file/deeper/sft", "a_file is a file, not a folder"),
    ("/sys/sft", "cannot write into /sys (Permission denied)"),  # sysfs refuses new files, to root too
])
def test_an_output_prefix_that_cannot_be_written_is_one_line(tmp_path, tokenizer_dir, prefix, says):
    (tmp_path / "a_file").write_text("not a folder")
    source = write_jsonl(tmp_path / "chats.jsonl", [{"conversation": CHAT}])
    with pytest.raises(SystemExit) as stopped:
        run("--input", source, "--tokenizer-path", str(tokenizer_dir), "--output-prefix", str(tmp_path / prefix))
    message = str(stopped.value)
    assert f"--output-prefix {tmp_path / prefix}: " in message and says in message and "\n" not in message
    assert (tmp_path / "a_file").read_text() == "not a folder"
