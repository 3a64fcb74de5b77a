"""The on-disk layout of a checkpoint directory (docs/architecture.md): tag names, `latest`, file-name patterns.

Every file name of a checkpoint is spelled here and nowhere else. The patterns follow DeepSpeed and
GPT-NeoX so their tools can read what we write and we can read what they wrote::

    <root>/latest                                              text: the newest complete tag
    <root>/save.lock                                           the run saving here (save_lock.py), while it runs
    <root>/global_step<N>/mp_rank_<MP:02d>_model_states.pt     module + client state
    <root>/global_step<N>/zero_pp_rank_<DP>_mp_rank_<MP:02d>_model_states.pt   (ZeRO-3, per DP rank)
    <root>/global_step<N>/[bf16_]zero_pp_rank_<DP>_mp_rank_<MP:02d>_optim_states.pt   ZeRO shards
    <root>/global_step<N>/layer_<II>-model_<MP:02d>-model_states.pt   GPT-NeoX pipeline layers
    <root>/global_step<N>/configs/*.yml                        the run's YAML files
    <root>/global_step<N>/configs/neox_config.yml              all its settings as one GPT-NeoX config
    <root>/global_step<N>/configs/neox_config_extra.yml        its settings GPT-NeoX does not have
    <root>/global_step<N>/manifest.json                        size and checksum of every other file
    <root>/global_step<N>.partial/                             a save in progress (or interrupted)

A tag is written as ``<tag>.partial`` and renamed to ``<tag>`` once every file is on disk, so a
folder named ``global_step<N>`` is never half written by us, and nothing lists a partial one.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterable
from pathlib import Path

from megatron.checkpointing.errors import CheckpointError
from megatron.fsio import write_text_atomically

LATEST_FILE = "latest"
LOCK_FILE = "save.lock"
CONFIGS_DIR = "configs"
NEOX_CONFIG_FILE = "neox_config.yml"
NEOX_CONFIG_EXTRA_FILE = "neox_config_extra.yml"
MANIFEST_FILE = "manifest.json"
TAG_PREFIX = "global_step"
PARTIAL_SUFFIX = ".partial"

TAG_RE = re.compile(rf"^{TAG_PREFIX}(\d+)$")
MODEL_STATES_RE = re.compile(r"^mp_rank_(?P<mp>\d+)_model_states\.pt$")
ZERO3_MODEL_STATES_RE = re.compile(r"^zero_pp_rank_(?P<dp>\d+)_mp_rank_(?P<mp>\d+)_model_states\.pt$")
# DeepSpeed prefixes the optimizer shards by mode, e.g. "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt".
OPTIM_STATES_RE = re.compile(r"^(?:(?P<prefix>[a-z0-9]+)_)?zero_pp_rank_(?P<dp>\d+)_mp_rank_(?P<mp>\d+)_optim_states\.pt$")
LAYER_FILE_RE = re.compile(r"^layer_(?P<layer>\d+)-model_(?P<mp>\d+)-model_states\.pt$")
# Written by ds_to_universal: a tag holding this folder can be loaded at another DP size.
UNIVERSAL_DIR = "zero"


def tag_for_iteration(iteration: int) -> str:
    return f"{TAG_PREFIX}{int(iteration)}"


def iteration_of_tag(tag: str) -> int | None:
    """The iteration a `global_step<N>` tag names; None for tags named otherwise."""
    match = TAG_RE.match(tag)
    return int(match.group(1)) if match else None


def partial_tag(tag: str) -> str:
    """The folder a tag is written into before it is complete."""
    return tag + PARTIAL_SUFFIX


def list_partial_tags(root: Path) -> list[str]:
    """Folders of saves that were interrupted (or are in progress) under `root`."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(child.name for child in root.iterdir() if child.name.endswith(PARTIAL_SUFFIX) and child.is_dir())


def same_directory(a: str | Path | None, b: str | Path | None) -> bool:
    if not a or not b:
        return False
    return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()


def model_states_name(mp_rank: int) -> str:
    return f"mp_rank_{mp_rank:02d}_model_states.pt"


def gathered_module_scratch_name(mp_rank: int) -> str:
    """Scratch file a ZeRO-3 save parks gathered weights in while it writes the full module file (then removed)."""
    return model_states_name(mp_rank) + ".gathered"


def zero3_model_states_name(dp_rank: int, mp_rank: int) -> str:
    return f"zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_model_states.pt"


def optim_states_name(dp_rank: int, mp_rank: int, prefix: str | None = None) -> str:
    lead = f"{prefix}_" if prefix else ""
    return f"{lead}zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"


def layer_file_name(layer: int, mp_rank: int) -> str:
    return f"layer_{layer:02d}-model_{mp_rank:02d}-model_states.pt"


def read_latest(root: Path) -> str | None:
    """The tag named in `<root>/latest`, or None when there is no such file."""
    path = Path(root) / LATEST_FILE
    if not path.exists():
        return None
    fix = f"Write the newest tag's name (e.g. '{TAG_PREFIX}1000') into it, or set `iteration: N` to pick a tag."
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise CheckpointError(f"cannot read {path}: {err.strerror or err}. Make it a readable text file. {fix}") from err
    try:
        tag = raw.decode("utf-8").strip()
    except UnicodeDecodeError as err:
        raise CheckpointError(f"{path} holds binary data, not a tag name (a damaged file?). {fix}") from err
    if not tag:
        raise CheckpointError(f"{path} is empty; it should name the newest complete checkpoint tag. {fix}")
    if not _is_plain_name(tag):
        raise CheckpointError(
            f"{path} names {tag!r}, which is not a folder directly inside {Path(root)}; a tag is loaded only "
            f"from the directory `latest` sits in. {fix}"
        )
    return tag


def _is_plain_name(tag: str) -> bool:
    return tag.isprintable() and tag not in (".", "..") and "/" not in tag and "\\" not in tag


def write_latest(root: Path, tag: str) -> None:
    """Point `latest` at `tag`, atomically and durably: a reader sees the old tag or the new one."""
    write_text_atomically(Path(root) / LATEST_FILE, tag)


def list_tags(root: Path) -> dict[str, int]:
    """`global_step<N>` folders under `root` -> N, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return {}
    found = {}
    for child in root.iterdir():
        iteration = iteration_of_tag(child.name)
        if iteration is not None and child.is_dir():
            found[child.name] = iteration
    return dict(sorted(found.items(), key=lambda item: item[1]))


def run_entries(folder: Path) -> list[str]:
    """The names in `folder` that belong to a run's checkpoints: `latest` and the tag it names, tags (also
    partial ones), the save lock, a manifest and a universal checkpoint's folder."""
    if not folder.is_dir():
        return []
    try:
        latest_tag = read_latest(folder)
    except CheckpointError:
        latest_tag = None
    return [entry.name for entry in sorted(folder.iterdir())
            if entry.name in (LATEST_FILE, LOCK_FILE, MANIFEST_FILE, UNIVERSAL_DIR, latest_tag)
            or (entry.is_dir() and iteration_of_tag(entry.name.removesuffix(PARTIAL_SUFFIX)) is not None)]


def copy_configs(config_files: dict[str, str] | None, tag_dir: Path) -> list[Path]:
    """Write the run's YAML files ({basename: text}) into `<tag_dir>/configs/`."""
    if not config_files:
        return []
    target = Path(tag_dir) / CONFIGS_DIR
    target.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in config_files.items():
        path = target / Path(name).name
        path.write_text(text)
        written.append(path)
    return written


def prune_checkpoints(root: Path, keep_last_n: int | None, lineage: Iterable[str], protected: Iterable[str] = ()) -> list[str]:
    """Delete the tags of `lineage` older than its newest `keep_last_n`; never a `protected` tag or the one `latest` names.

    `lineage` is the tags the caller may delete at all (those of the run that saves); any other tag
    under `root` stays. Call on one rank only. Returns the deleted tags.
    """
    if keep_last_n is None:
        return []
    if keep_last_n < 1:
        raise CheckpointError(
            f"keep_last_n_checkpoints is {keep_last_n}; it must be at least 1 (or unset to keep every tag)."
        )
    root = Path(root)
    keep = {*protected, read_latest(root)}
    lineage = set(lineage)
    ours = [tag for tag in list_tags(root) if tag in lineage]  # oldest first
    deleted = []
    for tag in ours[: max(len(ours) - keep_last_n, 0)]:
        if tag in keep:
            continue
        shutil.rmtree(root / tag)
        deleted.append(tag)
    return deleted
