"""Reading and writing Hugging Face model directories.

Read: ``config.json`` plus ``model.safetensors``, sharded safetensors named by
``model.safetensors.index.json``, or ``pytorch_model.bin`` (with or without an index, unpickled
weights-only by megatron.checkpointing.ondisk.safe_unpickle, so no code in it runs); tensors are yielded one
shard at a time so that at most one shard is held besides the converted result.
Write: ``config.json`` and ``model.safetensors`` (sharded with an index above a size limit).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from megatron.checkpointing import load_file_weights_only as load_weights_only
from megatron.hf.errors import HFConversionError

CONFIG_NAME = "config.json"
TOKENIZER_NAME = "tokenizer.json"
TOKENIZER_CONFIG_NAME = "tokenizer_config.json"
SAFETENSORS_NAME = "model.safetensors"
ADAPTER_CONFIG_NAME = "adapter_config.json"  # a PEFT adapter folder's
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
SAFETENSORS_INDEX_NAME = "model.safetensors.index.json"
BIN_NAME = "pytorch_model.bin"
BIN_INDEX_NAME = "pytorch_model.bin.index.json"
WEIGHT_NAMES = (SAFETENSORS_INDEX_NAME, SAFETENSORS_NAME, BIN_INDEX_NAME, BIN_NAME)  # in order of preference
# the other files transformers' save_pretrained writes into a model folder (we write none of them)
OTHER_MODEL_FOLDER_NAMES = ("generation_config.json", "special_tokens_map.json", "added_tokens.json",
                            "chat_template.jinja", "tokenizer.model", "vocab.json", "merges.txt")
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
_SIZE_UNITS = {"KB": 1024, "MB": 1024**2, "GB": 1024**3, "B": 1}


def parse_size(text: str) -> int:
    """'5GB', '200MB', '64KB' or a number of bytes -> bytes."""
    cleaned = text.strip().upper()
    unit = next((u for u in _SIZE_UNITS if cleaned.endswith(u)), "")  # KB before B
    number = cleaned.removesuffix(unit).strip() if unit else cleaned
    try:
        size = int(float(number) * _SIZE_UNITS.get(unit, 1))
    except ValueError:
        raise HFConversionError(f"shard size {text!r} is not a size; write e.g. 5GB, 200MB or 65536") from None
    if size <= 0:
        raise HFConversionError(f"shard size {text!r} must be positive")
    return size


def is_peft_dir(path: str | Path) -> bool:
    """A PEFT adapter folder (its adapter_config.json names the model folder it adapts)."""
    return (Path(path) / ADAPTER_CONFIG_NAME).is_file()


def is_hf_model_dir(path: str | Path) -> bool:
    """A directory holding config.json and Hugging Face weight files."""
    path = Path(path)
    return (path / CONFIG_NAME).is_file() and any((path / name).is_file() for name in WEIGHT_NAMES)


def read_hf_config(hf_dir: Path) -> dict[str, Any]:
    path = Path(hf_dir) / CONFIG_NAME
    if not path.is_file():
        raise HFConversionError(f"{hf_dir}: no {CONFIG_NAME}; a Hugging Face model directory needs one")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise HFConversionError(f"{path}: not valid JSON ({err})") from None


def weight_files(hf_dir: Path) -> list[Path]:
    """The weight files of ``hf_dir`` in a fixed order (each shard once)."""
    hf_dir = Path(hf_dir)
    for name in WEIGHT_NAMES:
        path = hf_dir / name
        if not path.is_file():
            continue
        if not name.endswith(".index.json"):
            return [path]
        try:
            weight_map = json.loads(path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as err:
            raise HFConversionError(f"{path}: not a weight index (needs a 'weight_map'): {err}") from None
        shards = [hf_dir / shard for shard in sorted(set(weight_map.values()))]
        absent = [str(s) for s in shards if not s.is_file()]
        if absent:
            raise HFConversionError(f"{path} names shards that do not exist: {', '.join(absent)}")
        return shards
    raise HFConversionError(f"{hf_dir}: no weights found; expected one of {', '.join(WEIGHT_NAMES)}")


def _shard_tensors(shard: Path) -> Iterator[tuple[str, torch.Tensor]]:
    if shard.suffix == ".safetensors":
        try:
            with safe_open(str(shard), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 (safe_open handles are not iterable)
                    yield name, handle.get_tensor(name)
        except OSError as err:
            raise HFConversionError(f"{shard}: cannot be read as safetensors ({err}); the file may be truncated") from None
        return
    state = load_weights_only(shard)
    if not isinstance(state, dict):
        raise HFConversionError(f"{shard} holds a {type(state).__name__}, not a state dict of named tensors")
    yield from state.items()


def iter_hf_tensors(hf_dir: Path, progress: bool = False,
                    check: Callable[[Path, str, torch.Tensor], None] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every weight in ``hf_dir``, one shard at a time; ``check(shard, name, tensor)`` first."""
    shards = weight_files(hf_dir)
    for shard in tqdm(shards, desc="reading shards", unit="shard", disable=not progress):
        for name, tensor in _shard_tensors(shard):
            if check is not None:
                check(shard, name, tensor)
            yield name, tensor


def _shard_groups(tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[list[str]]:
    groups: list[list[str]] = [[]]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return groups


def write_hf_dir(
    out_dir: Path,
    config: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    tokenizer_file: Path | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    progress: bool = False,
    special_tokens: dict[str, str] | None = None,
) -> list[Path]:
    """Write config.json, the weights (safetensors, sharded above ``max_shard_bytes``) and the tokenizer.

    ``special_tokens`` ({"eos_token": "<|endoftext|>", ...}) go into tokenizer_config.json, so that
    AutoTokenizer knows them.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    groups = _shard_groups(tensors, max_shard_bytes)
    if len(groups) == 1:
        names = [SAFETENSORS_NAME]
    else:
        names = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    written = []
    for name, group in tqdm(list(zip(names, groups, strict=True)), desc="writing shards", disable=not progress):
        save_file({k: tensors[k].contiguous() for k in group}, str(out_dir / name), metadata={"format": "pt"})
        written.append(out_dir / name)
    if len(groups) > 1:
        index = {
            "metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
            "weight_map": {k: name for name, group in zip(names, groups, strict=True) for k in group},
        }
        (out_dir / SAFETENSORS_INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    if tokenizer_file is not None:
        shutil.copyfile(tokenizer_file, out_dir / TOKENIZER_NAME)
        if special_tokens:
            (out_dir / TOKENIZER_CONFIG_NAME).write_text(json.dumps(special_tokens, indent=2) + "\n")
    return written
