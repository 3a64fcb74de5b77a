"""What a checkpoint directory holds, found by looking at file names and small metadata only.

No engine is touched. The metadata of a tag (ZeRO stage, precision, saved settings, client state)
comes from its model-states file, read once per file by module_weights.load_checkpoint_file:
checked against the tag's manifest first (where it has one), then unpickled weights-only and
memory-mapped, so the weights inside are not copied.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.formats.weights_source import WeightsSource
from megatron.checkpointing.ondisk import layout, manifest
from megatron.checkpointing.ondisk.client_state import ClientState
from megatron.checkpointing.ondisk.identity import LoraBase
from megatron.contract.architecture import experts_per_rank
from megatron.optim.optimizer_layout import precision_of, zero_stage_of

FORMAT_DEEPSPEED = "deepspeed"  # mp_rank_XX_model_states.pt holds the module
FORMAT_PIPELINE = "pipeline"  # GPT-NeoX layer_XX-model_YY-model_states.pt files hold it
FORMAT_ZERO3 = "zero3"  # only ZeRO-3 partitions: zero_pp_rank_X_mp_rank_YY_model_states.pt
FORMAT_HF = "hf"  # a Hugging Face model folder: config.json + weights, read through a WeightsSource
FORMAT_INCOMPLETE = "incomplete"  # a tag folder without any module file

@dataclass(frozen=True)
class SavedMetadata:
    """The small facts a model-states file holds about the run that wrote it."""

    source: Path
    zero_stage: int
    precision: str
    dp_world_size: int | None
    global_steps: int | None  # DeepSpeed's count of optimizer steps
    has_module_weights: bool  # False for ZeRO-3 placeholders and GPT-NeoX pipeline metadata files
    has_optimizer_in_file: bool  # without ZeRO the optimizer state lives in this file
    client_state: ClientState = field(repr=False)

    @property
    def saved_args(self) -> dict[str, Any] | None:
        return self.client_state.settings


def _holds_weights(module: Any) -> bool:
    if not isinstance(module, dict):
        return False
    return any(getattr(value, "numel", lambda: 0)() > 0 for value in module.values())


@lru_cache(maxsize=32)
def _read_metadata_cached(path: str, _mtime_ns: int, _size: int) -> SavedMetadata:
    from megatron.checkpointing.ondisk.module_weights import load_checkpoint_file

    state = load_checkpoint_file(Path(path))
    if not isinstance(state, dict):
        raise CheckpointError(
            f"checkpoint file {path} holds a {type(state).__name__}, not a DeepSpeed model-states dict."
        )
    ds_config = state.get("ds_config") if isinstance(state.get("ds_config"), dict) else {}
    client_state = ClientState.from_dict(state)  # its own keys; DeepSpeed's beside them are not client state
    saved_args = client_state.settings or {}
    zero_stage = zero_stage_of(ds_config.get("zero_optimization"), saved_args.get("zero_stage", 0))
    precision = precision_of(saved_args.get("precision"), ds_config.get("fp16"),
                             ds_config.get("bf16") or ds_config.get("bfloat16"))
    return SavedMetadata(
        source=Path(path),
        zero_stage=int(zero_stage),
        precision=precision,
        dp_world_size=state.get("dp_world_size"),
        global_steps=state.get("global_steps"),
        has_module_weights=_holds_weights(state.get("module")),
        has_optimizer_in_file=state.get("optimizer") is not None,
        client_state=client_state,
    )


def read_saved_metadata(path: Path) -> SavedMetadata:
    """Metadata of one model-states file, cached per (path, mtime, size)."""
    stat = Path(path).stat()
    return _read_metadata_cached(str(path), stat.st_mtime_ns, stat.st_size)


@dataclass(frozen=True)
class SavedLayout:
    """How a tag's state was split when it was saved: every reader (the load plan, its checks, the
    reshard, the converters, inspect_checkpoint) takes these numbers from here.

    The tensor-parallel size is the larger of the mp_rank files present and the saved settings' size, so a
    tag that lost a rank's file is read as the size it was saved at (and the missing file is named), never
    as a smaller model. The data-parallel size is DeepSpeed's recorded ``dp_world_size``, else the highest
    data-parallel rank of the optimizer shards plus one (a missing shard in the middle still counts).

    ``experts`` is the saved settings' moe_num_experts (1: no experts, or none recorded); each tensor-parallel
    rank's file holds ``experts_per_rank`` of them, whole (megatron/model/partitioning.py).

    ``lora_base`` is set for a LoRA run's adapter-only tag: it holds the parameters that train (the adapters,
    a reward model's head) and their optimizer states, and the frozen base is the one named there.
    """

    source_format: str
    tensor_parallel: int
    pipeline_stages: int
    data_parallel: int
    zero_stage: int | None  # None without a model-states file to read it from
    precision: str | None
    lora_base: LoraBase | None = None  # set: LoRA adapters only, over this base
    experts: int = 1

    @property
    def adapters_only(self) -> bool:
        return self.lora_base is not None

    @property
    def experts_per_rank(self) -> int:
        return experts_per_rank(self.experts, self.tensor_parallel)

    def describe(self) -> str:
        over_base = (f"; LoRA adapters only, over base {self.lora_base.path} (checksum {self.lora_base.checksum})"
                     if self.adapters_only else "")
        experts = f", {self.experts} experts ({self.experts_per_rank} per rank)" if self.experts > 1 else ""
        return (f"{self.source_format}: DP {self.data_parallel} x TP {self.tensor_parallel} x PP {self.pipeline_stages}, "
                f"ZeRO-{self.zero_stage}, {self.precision}{experts}{over_base}")


@dataclass(frozen=True)
class TagInventory:
    """The files of one tag folder, by kind and rank."""

    tag: str
    path: Path
    iteration: int | None  # from the tag name
    model_states_files: dict[int, Path]  # mp rank -> mp_rank_XX_model_states.pt
    zero3_model_states_files: dict[tuple[int, int], Path]  # (dp, mp) -> ZeRO-3 model-states file
    optimizer_files: dict[tuple[int, int], Path]  # (dp, mp) -> *zero_pp_rank_X_mp_rank_YY_optim_states.pt
    layer_files: tuple[Path, ...]
    universal: bool  # ds_to_universal output present: loadable at another DP size

    @property
    def exists(self) -> bool:
        return self.path.is_dir()

    @property
    def format(self) -> str:
        if self.layer_files:
            return FORMAT_PIPELINE
        if self.model_states_files:
            return FORMAT_DEEPSPEED
        if self.zero3_model_states_files:
            return FORMAT_ZERO3
        return FORMAT_INCOMPLETE

    @property
    def metadata_file(self) -> Path | None:
        """The file the tag's metadata (client state, DeepSpeed config) is read from."""
        if self.model_states_files:
            return self.model_states_files[min(self.model_states_files)]
        if self.zero3_model_states_files:
            return self.zero3_model_states_files[min(self.zero3_model_states_files)]
        return None

    @cached_property
    def metadata(self) -> SavedMetadata | None:
        return read_saved_metadata(self.metadata_file) if self.metadata_file else None

    @cached_property
    def manifest(self) -> dict[str, manifest.FileRecord] | None:
        """The tag's manifest, read once (None without one; refused when damaged: manifest.read_manifest)."""
        return manifest.read_manifest(self.path)

    @property
    def mp_ranks(self) -> tuple[int, ...]:
        """The tensor-parallel ranks of the tag's files."""
        if self.layer_files:  # a pipeline's mp_rank files count (stage, tensor-parallel rank) pairs
            return tuple(sorted({int(layout.LAYER_FILE_RE.match(p.name)["mp"]) for p in self.layer_files}))
        ranks = set(self.model_states_files)
        ranks.update(mp for _, mp in self.zero3_model_states_files)
        ranks.update(mp for _, mp in self.optimizer_files)
        return tuple(sorted(ranks))

    @property
    def engine_mp_ranks(self) -> tuple[int, ...]:
        """DeepSpeed's mp_rank numbers in the model-states and optimizer file names: the tensor-parallel ranks,
        or for a pipeline every (stage, tensor-parallel rank) pair, stage-major."""
        if not self.layer_files:
            return self.mp_ranks
        return tuple(sorted({*self.model_states_files, *(mp for _, mp in self.optimizer_files)}))

    @property
    def saved_pp_size(self) -> int:
        """Pipeline stages the tag was saved with: 1 without layer files."""
        if not self.layer_files:
            return 1
        args = self.metadata.saved_args if self.metadata else None
        recorded = int((args or {}).get("pipe_parallel_size") or 0)
        return recorded if recorded > 1 else max(len(self.engine_mp_ranks) // len(self.mp_ranks), 1)

    @property
    def optimizer_dp_ranks(self) -> tuple[int, ...]:
        return tuple(sorted({dp for dp, _ in self.optimizer_files}))

    @cached_property
    def saved_layout(self) -> SavedLayout:
        """The one answer to "what was saved, at what layout" (see SavedLayout)."""
        settings = (self.metadata.saved_args if self.metadata else None) or {}
        recorded_dp = self.metadata.dp_world_size if self.metadata else None
        return SavedLayout(
            source_format=self.format,
            tensor_parallel=max(max(self.mp_ranks, default=0) + 1, int(settings.get("model_parallel_size") or 1)),
            pipeline_stages=self.saved_pp_size,
            data_parallel=int(recorded_dp or (max(self.optimizer_dp_ranks) + 1 if self.optimizer_files else 1)),
            zero_stage=self.metadata.zero_stage if self.metadata else None,
            precision=self.metadata.precision if self.metadata else None,
            lora_base=LoraBase.from_dict(self.metadata.client_state.lora_base, self.path) if self.metadata else None,
            experts=int(settings.get("moe_num_experts") or 1),
        )

    @property
    def has_optimizer_states(self) -> bool:
        if self.optimizer_files:
            return True
        return bool(self.metadata and self.metadata.has_optimizer_in_file)

    @property
    def files(self) -> tuple[Path, ...]:
        """Every checkpoint file of the tag."""
        return tuple(sorted({
            *self.model_states_files.values(), *self.zero3_model_states_files.values(),
            *self.optimizer_files.values(), *self.layer_files,
        }))


@dataclass(frozen=True)
class CheckpointInventory:
    """What `load_dir` holds: tags and their iterations, the `latest` tag, or a Hugging Face model."""

    root: Path
    exists: bool
    latest: str | None
    tags: dict[str, TagInventory]  # oldest first
    hf_files: tuple[Path, ...] = ()  # what a load reads: config.json, then the weights
    hf_source: WeightsSource | None = field(default=None, repr=False, compare=False)  # what reads them
    partial_tags: tuple[str, ...] = ()  # `<tag>.partial` folders of interrupted saves, never loaded

    @property
    def is_hf(self) -> bool:
        return bool(self.hf_files)

    @property
    def format(self) -> str | None:
        if self.is_hf:
            return FORMAT_HF
        if self.latest in self.tags:
            return self.tags[self.latest].format
        return None

    def chosen_tag(self, iteration: int | None = None, tag: str | None = None,
                   pick_with: str = "`iteration: {iteration}`") -> TagInventory:
        """The one rule for which tag a load, an inspection or a conversion reads, checked here once: `tag` when
        named, else `global_step<iteration>` when an iteration is asked for, else the tag `latest` names. A
        name that does not exist, a missing `latest`, and a `.partial` folder (an interrupted save) are refused
        in one line; `pick_with` says how the caller's user names another tag (fields {iteration}, {tag})."""
        root, latest_file = self.root, self.root / layout.LATEST_FILE
        if not self.exists:
            what = "is a file, not a checkpoint folder" if root.is_file() else "does not exist"
            raise CheckpointError(f"{root} {what}; name the checkpoint folder (it holds `{layout.LATEST_FILE}` and "
                                  "global_step<N> folders)")

        def pick(newest: TagInventory | None = None) -> str:
            if newest is None:
                return pick_with.format(iteration="N", tag="TAG")
            return pick_with.format(iteration=newest.iteration, tag=newest.tag)

        if tag is None and iteration is not None:
            tag = layout.tag_for_iteration(iteration)
            if tag not in self.tags:
                raise CheckpointError(
                    f"`iteration: {iteration}` asks for {root / tag}, which does not exist; {self.available()} in "
                    f"{root}. Set `iteration` to one of them, or unset it to load the tag named in {latest_file}.")
        from_latest = tag is None
        if from_latest:
            if self.latest is None:
                raise CheckpointError(f"{root} has no `{layout.LATEST_FILE}` file naming the tag to load; "
                                      f"{self.available()}. Set {pick()} to pick one.")
            tag = self.latest
        named = f"{latest_file} names" if from_latest else "the tag asked for is"
        if tag.endswith(layout.PARTIAL_SUFFIX):
            newest = list(self.tags.values())[-1] if self.tags else None
            way_out = ((f"Write '{newest.tag}' (the newest complete tag) into it, or set {pick(newest)}."
                        if from_latest else f"Ask for '{newest.tag}', the newest complete tag.")
                       if newest else "Remove it; the directory holds no complete tag to load.")
            raise CheckpointError(f"{named} '{tag}', the folder of an interrupted or unfinished save, which is never "
                                  f"loaded. {way_out}")
        if tag not in self.tags:
            fix = f", or fix the `{layout.LATEST_FILE}` file" if from_latest else ""
            named = f"{latest_file} names tag" if from_latest else "the tag asked for is"
            raise CheckpointError(f"{named} '{tag}', but {root / tag} does not exist; {self.available()}. Set "
                                  f"{pick()} to pick one{fix}.")
        return self.tags[tag]

    def available(self) -> str:
        """The tags a user may pick instead, in words."""
        if self.iterations:
            return f"available iterations: {self.iterations}"
        return f"available tags: {list(self.tags)}" if self.tags else "it holds no global_step<N> tags"

    @property
    def iterations(self) -> list[int]:
        return [t.iteration for t in self.tags.values() if t.iteration is not None]

    @property
    def is_empty(self) -> bool:
        return not self.tags and self.latest is None and not self.is_hf


def inventory_tag(root: Path, tag: str) -> TagInventory:
    path = Path(root) / tag
    model_states, zero3_states, optimizer, layers = {}, {}, {}, []
    if path.is_dir():
        for child in path.iterdir():
            name = child.name
            if match := layout.MODEL_STATES_RE.match(name):
                model_states[int(match.group(1))] = child
            elif match := layout.ZERO3_MODEL_STATES_RE.match(name):
                zero3_states[(int(match.group(1)), int(match.group(2)))] = child
            elif match := layout.OPTIM_STATES_RE.match(name):
                optimizer[(int(match.group(2)), int(match.group(3)))] = child
            elif layout.LAYER_FILE_RE.match(name):
                layers.append(child)
    return TagInventory(
        tag=tag,
        path=path,
        iteration=layout.iteration_of_tag(tag),
        model_states_files=dict(sorted(model_states.items())),
        zero3_model_states_files=dict(sorted(zero3_states.items())),
        optimizer_files=dict(sorted(optimizer.items())),
        layer_files=tuple(sorted(layers)),
        universal=(path / layout.UNIVERSAL_DIR).is_dir(),
    )


def inventory_checkpoint(load_dir: str | Path, hf_source: WeightsSource | None = None) -> CheckpointInventory:
    """Describe `load_dir` without touching any engine; weights are never read.

    With `hf_source` (megatron.hf.HF_FOLDER), a Hugging Face model folder is recognised too.
    """
    root = Path(load_dir).expanduser()
    if not root.is_dir():
        return CheckpointInventory(root=root, exists=False, latest=None, tags={})
    latest = layout.read_latest(root)
    names = list(layout.list_tags(root))
    if latest is not None and latest not in names and (root / latest).is_dir() and not latest.endswith(
            layout.PARTIAL_SUFFIX):
        names.append(latest)  # a tag named otherwise than global_step<N>
    tags = {name: inventory_tag(root, name) for name in names}
    partial_tags = tuple(layout.list_partial_tags(root))
    if hf_source is not None and hf_source.detect(root):
        return CheckpointInventory(root=root, exists=True, latest=latest, tags=tags, partial_tags=partial_tags,
                                   hf_files=hf_source.files(root), hf_source=hf_source)
    return CheckpointInventory(root=root, exists=True, latest=latest, tags=tags, partial_tags=partial_tags)
