"""Chat records -> token, label and reward datasets, as GPT-NeoX's preprocess_data_with_chat_template.py writes them.

For each jsonl key: `{prefix}_{key}_document` (the chat through the tokenizer's chat template),
`{prefix}_{key}_label_document` (aligned with the tokens, unshifted: the token id where it is trained,
-100 where it is masked) and, with a reward key, `{prefix}_{key}_reward_document` (one value per chat).
Labels are built turn by turn: each turn's tokens are what the template adds for it, the generation
prompt belonging to the turn before the generating role's turn. That needs a prefix-stable template (the
rendering of a chat's first turns begins the rendering of the whole chat), which is checked for every chat.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megatron.data.data_vocabulary import write_vocabulary_record
from megatron.data.document_sources import iter_jsonl_records, missing_key_error
from megatron.data.errors import DataError
from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder
from megatron.data.preprocessing import (
    PreprocessResult,
    chunks,
    encode_into_builders,
    output_prefix_for,
    staged_datasets,
)

MASKED = -100
TOKEN_DTYPE = np.dtype(np.int32)  # GPT-NeoX's choice for tokens and labels (labels hold -100)


@dataclass(frozen=True)
class ChatOptions:
    jsonl_keys: tuple[str, ...] = ("conversation",)
    mask: bool = True  # False (--no-mask): every token is trained, no end token is appended
    for_rm: bool = False
    generation_role: str = "assistant"
    only_last: bool = False
    reward_key: str | None = None
    binary_reward: bool = False


def _template_ids(tokenizer, chat: list[dict], add_generation_prompt: bool = False) -> list[int]:
    ids = tokenizer.apply_chat_template(chat, tokenize=True, add_generation_prompt=add_generation_prompt)
    if isinstance(ids, Mapping):  # a BatchEncoding, the default of newer transformers
        ids = ids["input_ids"]
    return list(ids)


def build_chat(chat: list[dict], tokenizer, options: ChatOptions, field: str = "chat") -> tuple[list[int], list[int]]:
    """(tokens, labels) of one chat; `field` names it in errors ("file:line: field 'key'")."""
    if not options.mask:
        tokens = _template_ids(tokenizer, chat)
        return tokens, list(tokens)
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DataError("the tokenizer has no eos token, which ends every chat; set eos_token in its "
                        "tokenizer_config.json, or use --no-mask")
    if options.for_rm:
        # The reward is read where the loss mask is on, i.e. at the input token before the last label:
        # the first of two appended eos tokens.
        tokens = _template_ids(tokenizer, chat)
        return tokens + [eos, eos], [MASKED] * (len(tokens) + 1) + [eos]
    roles = [turn["role"] for turn in chat]
    if options.generation_role not in roles:
        raise DataError(f"{field} has no {options.generation_role!r} message (its roles: {', '.join(roles)}), so none "
                        "of its tokens would be trained; name the role that answers with --generation-role, or "
                        "train every token with --no-mask")
    tokens: list[int] = []
    labels: list[int] = []
    for i, turn in enumerate(chat):
        next_is_generation = i + 1 < len(chat) and chat[i + 1]["role"] == options.generation_role
        rendered = _template_ids(tokenizer, chat[: i + 1], add_generation_prompt=next_is_generation)
        _check_prefix_stable(tokens, rendered, i, field)
        turn_tokens = rendered[len(tokens):]
        if not turn_tokens:
            raise DataError(f"{field}: the chat template renders nothing for message {i + 1} (role "
                            f"{turn['role']!r}), a role it does not know; use the roles the template knows")
        tokens.extend(turn_tokens)
        trained = turn["role"] == options.generation_role and (not options.only_last or i == len(chat) - 1)
        labels.extend(turn_tokens if trained else [MASKED] * len(turn_tokens))
    labels.append(eos if labels and labels[-1] != MASKED else MASKED)
    tokens.append(eos)
    return tokens, labels


def _check_prefix_stable(before: list[int], rendered: list[int], turns: int, field: str) -> None:
    """The labels give each turn the tokens its message adds to the rendering of the turns before it; that
    holds only when that rendering is the start of this one."""
    if rendered[: len(before)] == before:
        return
    pairs = zip(before, rendered, strict=False)
    differ = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(before), len(rendered)))
    raise DataError(f"{field}: the chat template is not prefix-stable: its rendering of the first {turns} message(s) "
                    f"is not the start of its rendering of the first {turns + 1} (tokens differ at position {differ}), "
                    "so the loss mask would not match the tokens; use a template whose rendering of a chat's first "
                    "messages begins its rendering of the whole chat, or --no-mask")


def reward_value(value, binary: bool, where: str) -> float:
    """The reward to write of a record's `value`; DataError naming `where` unless it is a finite number that
    float32, the reward file's widest type, holds."""
    if not isinstance(value, (bool, int, float)):
        raise DataError(f"{where} is {value!r}, not a number")
    largest = float(np.finfo(np.float32).max)
    if not math.isfinite(value) or abs(value) > largest:
        raise DataError(f"{where} is {value}; a reward must be a finite number within float32's range "
                        f"(+-{largest:.3g}), above 0 for a desirable answer, below 0 for an undesirable one")
    if binary:
        return 1 if value > 0 else -1
    return value


def _check_chat(chat, where: str, key: str) -> None:
    if not isinstance(chat, list) or not chat:
        raise DataError(f"{where}: field {key!r} is {'an empty chat' if chat == [] else repr(chat)[:60]}; it must be "
                        "a non-empty list of {\"role\": ..., \"content\": ...} messages")
    for number, turn in enumerate(chat, start=1):
        if not isinstance(turn, dict) or "role" not in turn or "content" not in turn:
            raise DataError(f"{where}: field {key!r} holds {repr(turn)[:60]}, not a message with a role and content")
        for part in ("role", "content"):
            if not isinstance(turn[part], str):
                raise DataError(f"{where}: field {key!r} message {number} has the {part} {json.dumps(turn[part])[:60]}, "
                                f"not a string; write its {part} as a JSON string")


_worker_tokenizer = None


def _init_worker(tokenizer_path: str) -> None:
    global _worker_tokenizer
    _worker_tokenizer = load_chat_tokenizer(tokenizer_path)


def load_chat_tokenizer(tokenizer_path: str):
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)
    except (OSError, ValueError) as err:
        raise DataError(f"--tokenizer-path {tokenizer_path!r} is not a Hugging Face tokenizer folder "
                        f"({str(err).splitlines()[0]}); give a folder with tokenizer.json and tokenizer_config.json") from err
    if not tokenizer.chat_template:
        raise DataError(f"--tokenizer-path {tokenizer_path!r} has no chat template; add a chat_template to its "
                        "tokenizer_config.json (or chat_template.jinja)")
    return tokenizer


def _encode_chunk(job: tuple[list[tuple[str, int, dict]], ChatOptions]) -> list[dict[str, list]]:
    from jinja2 import TemplateError

    records, options = job
    encoded = []
    for path, line_number, record in records:
        where = f"{path}:{line_number}"
        sequences: dict[str, list] = {}
        for key in options.jsonl_keys:
            if key not in record:
                raise missing_key_error(Path(path), line_number, key, record)
            _check_chat(record[key], where, key)
            try:
                tokens, labels = build_chat(record[key], _worker_tokenizer, options, f"{where}: field {key!r}")
            except TemplateError as err:
                raise DataError(f"{where}: the chat template rejects field {key!r} ({err}); fix the record "
                                "or the template") from None
            sequences[key] = tokens
            sequences[f"{key}_label"] = labels
            if options.reward_key is not None:
                if options.reward_key not in record:
                    raise missing_key_error(Path(path), line_number, options.reward_key, record, "--reward-key")
                sequences[f"{key}_reward"] = [reward_value(record[options.reward_key], options.binary_reward,
                                                           f"{where}: reward field {options.reward_key!r}")]
        encoded.append(sequences)
    return encoded


class _RewardCollector:
    """Holds the one value per chat until the end, when their dtype is known: int32 if all are whole numbers
    int32 holds, else float32."""

    def __init__(self):
        self.values: list[float] = []
        self.dtype = np.dtype(np.int32)

    def add_item(self, values) -> None:
        self.values.extend(values)

    def end_document(self) -> None:
        pass

    def write(self, bin_path: str, idx_path: str) -> None:
        int32 = np.iinfo(np.int32)
        whole = all(float(v).is_integer() and int32.min <= v <= int32.max for v in self.values)
        builder = MMapIndexedDatasetBuilder(bin_path, np.int32 if whole else np.float32)
        for value in self.values:
            builder.add_item([value])
            builder.end_document()
        builder.finalize(idx_path)


def chats_to_indexed_datasets(
    paths: list[Path],
    output_prefix: str | Path,
    tokenizer_path: str,
    options: ChatOptions,
    workers: int = 1,
    chunksize: int = 25,
    progress: bool = False,
    log_interval: int = 100,
    expected_documents: int | None = None,
) -> PreprocessResult:
    tokenizer = load_chat_tokenizer(tokenizer_path)
    reward_names = [f"{key}_reward" for key in options.jsonl_keys] if options.reward_key else []
    names = [*options.jsonl_keys, *(f"{key}_label" for key in options.jsonl_keys), *reward_names]
    if len(set(names)) < len(names):
        raise DataError(f"--jsonl-keys {list(options.jsonl_keys)} would write one output twice (a key named like "
                        "another key's _label or _reward output); rename the fields")
    prefixes = {name: output_prefix_for(output_prefix, name) for name in names}
    records: Iterable = ((str(path), line, record) for path, line, record in iter_jsonl_records(paths))
    jobs = ((chunk, options) for chunk in chunks(records, chunksize))
    with staged_datasets(output_prefix, prefixes) as staged:
        builders = {name: _RewardCollector() if name in reward_names else MMapIndexedDatasetBuilder(bin_path, TOKEN_DTYPE)
                    for name, (bin_path, _) in staged.items()}
        documents, tokens, seconds = encode_into_builders(
            jobs, _encode_chunk, _init_worker, (tokenizer_path,), builders, workers, progress, log_interval,
            expected_documents, counted=lambda name: name in options.jsonl_keys)
        for name, (bin_path, idx_path) in staged.items():
            builder = builders[name]
            if isinstance(builder, _RewardCollector):
                builder.write(bin_path, idx_path)
            else:
                builder.finalize(idx_path)
    for key in options.jsonl_keys:
        write_vocabulary_record(prefixes[key], len(tokenizer), builders[key].max_token_id, "HFTokenizer")
    return PreprocessResult(prefixes, documents, tokens, seconds)
