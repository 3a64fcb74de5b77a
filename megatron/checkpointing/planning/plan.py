"""The load plan: what a run will load and what starts fresh, decided before any engine exists.

| setting                 | weights | optimizer | LR schedule       | iteration       | RNG states              | data position  |
| `load` only (resume)    | yes     | yes       | continues         | from checkpoint | yes, unless no_load_rng | from iteration |
| `load` + `no_load_optim`| yes     | fresh     | restarts (warmup) | from checkpoint | yes, unless no_load_rng | from iteration |
| `load` + `finetune`     | yes     | fresh     | restarts (warmup) | 0               | no                      | start          |

A tag saved with `no_save_optim` holds no optimizer states by design: a full resume of it loads as the
`no_load_optim` row and says so in one note; a tag that lost its optimizer files is still refused.

`iteration: N` picks tag `global_step<N>`; otherwise the tag in `latest`. The learning rate is a
function of the schedule's step (megatron/training/learning_rates.py), counted from the iteration the schedule
started at: a fresh optimizer starts a fresh schedule, so after `no_load_optim` the schedule's step
is not the iteration (`schedule_start`).

A reward model (train_impl rm) has a scalar head (rm_linear) in place of the output layer (final_linear).
Its weights-only loads (finetune, no_load_optim, a Hugging Face folder) from a source that was not a reward
model -- a language model's checkpoint or a Hugging Face causal LM -- load everything but final_linear and
keep the head as initialised (`fresh_reward_head`, said in the plan); any other load is strict as usual,
and a full resume of a language model's checkpoint into a reward model is refused.

A LoRA run (lora_rank > 0) starts its adapters fresh over the weights of a source without adapters (a
checkpoint saved without lora_rank, a Hugging Face folder) in a weights-only load (`fresh_adapters`, said in
the plan); a full resume of such a checkpoint into a LoRA run is refused. A LoRA run's own tags load strictly,
and so does a PEFT adapter folder: its adapters with the base model it names (megatron/hf/peft.py).

A LoRA run over a base it loaded (a fine-tune of a tag or folder without adapters, or a load of one of its
own tags) saves adapter-only tags: the parameters that train, their optimizer states and the run's state,
and the base's identity (`lora_base`: source, tag, checksum and the Hugging Face folder holding it, the table
in LoadPlan.lora_base; `SavedLayout.lora_base` is where a reader learns that a tag is one). A PEFT adapter
folder's base is the model folder it names, and its saves are adapter-only too. Loading such a tag plans the
base's module-only load from the recorded source (`base`), refused in one line when the base is gone or its
files changed, and then the tag as any tag of its mode; a tag without some adapter the model has is refused,
never loaded with fresh ones. A LoRA run from scratch (no `load`) has no base to name, and saves full tags.

The plan is the whole contract of a load: `load.load_checkpoint(engine, plan)` reads no settings.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.formats.weights_source import WeightsSource
from megatron.checkpointing.ondisk import layout
from megatron.checkpointing.ondisk.client_state import ClientState
from megatron.checkpointing.ondisk.identity import (
    LORA_BASE_FILE,
    LoraBase,
    ReferenceIdentity,
    files_checksum,
    read_lora_base_file,
)
from megatron.checkpointing.ondisk.inventory import (
    FORMAT_HF,
    FORMAT_INCOMPLETE,
    FORMAT_PIPELINE,
    FORMAT_ZERO3,
    CheckpointInventory,
    TagInventory,
    inventory_checkpoint,
)
from megatron.checkpointing.planning import preflight, shape
from megatron.checkpointing.planning.data_position import DataPosition, data_position, resume_change_notes
from megatron.checkpointing.planning.load_settings import LoadSettings
from megatron.contract.architecture import Architecture, ModelConfigError, describe_model

# Parameter-name endings of a language model's output layer and of a reward model's head.
LM_HEAD = ("final_linear.weight",)
REWARD_HEAD = ("rm_linear.weight",)
ADAPTERS = (".lora_A", ".lora_B")  # megatron/model/lora.py's adapter weights


class LoadMode(str, enum.Enum):
    RESUME = "resume"
    NO_LOAD_OPTIM = "no_load_optim"
    FINETUNE = "finetune"
    FIRST_RUN = "auto_resume_first_run"  # load == save and nothing saved yet: start from scratch


@dataclass(frozen=True)
class LoadPlan:
    mode: LoadMode
    load_dir: Path
    tag: str | None = None
    tag_dir: Path | None = None
    source_format: str | None = None
    saved_iteration: int | None = None
    load_optimizer: bool = False
    iteration_from_checkpoint: bool = False
    restore_rng: bool = False
    data_position: DataPosition | None = None  # where the data continue; None when they start afresh
    files: tuple[Path, ...] = ()
    notes: tuple[str, ...] = ()
    strict: bool = True  # load_module_strict
    allow_random: tuple[str, ...] = ()  # load_module_allow_random: patterns of layers that may stay random
    validate_forward: bool = False  # checkpoint_validation_with_forward_pass (never for a Hugging Face folder)
    precision: str = "fp32"  # the run's, which forward validation compares in
    # The run's model (its settings' architecture()), resolved only where the weights are re-split for it
    # (another tensor-parallel size, a Hugging Face folder): inspecting a plan needs no padded vocabulary.
    run_architecture: Callable[[], Architecture] | None = field(default=None, repr=False, compare=False)
    lr_schedule_start: int = 0  # the iteration the LR schedule counts from after this load
    model: str | None = None  # the model's family and variants (architecture.describe_model)
    layout_change: shape.LayoutChange | None = None  # saved layout against the run's (shape.py); None for HF
    saves_here: bool = False  # `save` is the directory loaded from: the loaded tag is the run's own history
    tag_inventory: TagInventory | None = field(default=None, repr=False, compare=False)
    hf_source: WeightsSource | None = field(default=None, repr=False, compare=False)  # reads a FORMAT_HF folder
    fresh_reward_head: bool = False  # a reward model from a language model: its head as initialised, see above
    fresh_adapters: bool = False  # LoRA over a source without adapters: the adapters as initialised, see above
    base: LoadPlan | None = None  # the module-only load of the base under an adapter-only tag, see above

    @property
    def architecture(self) -> Architecture:
        return self.run_architecture()

    @property
    def shape_change(self) -> shape.ShapeChange | None:
        """A full resume at another shape (loading/reshard.py)."""
        return self.layout_change.resume if self.layout_change is not None else None

    @property
    def nothing_to_load(self) -> bool:
        return self.mode is LoadMode.FIRST_RUN

    @property
    def module_only(self) -> bool:
        return not self.nothing_to_load and not self.load_optimizer

    @functools.cached_property
    def weights_checksum(self) -> str:
        """A digest of the checksum of each file this module-only plan reads (identity.py); computed once per
        plan: a DPO/KTO reference and a LoRA run's base over the same source both name it."""
        root = self.tag_dir if self.tag_dir is not None else self.load_dir
        return files_checksum(self.files, root, self.tag_inventory.manifest if self.tag_inventory is not None else None)

    @property
    def lora_base(self) -> LoraBase | None:
        """The frozen base a LoRA run's saves name after this load (computes a checksum); None when there is none.

        | the load                                        | its base                          | its hf_folder                  |
        | an adapter-only tag (resume or fine-tune)       | the base the tag recorded         | the one the tag recorded       |
        | fresh adapters over a Hugging Face folder       | that folder                       | that folder                    |
        | fresh adapters over a tag without adapters      | that tag                          | its `converted_from` (a run's  |
        |                                                 |                                   | tags have none: they trained)  |
        | a PEFT adapter folder                           | the model folder it names (the    | that model folder              |
        |                                                 | checksum: of that folder's files) |                                |
        | a LoRA run's full tag, or no LoRA               | none                              |                                |
        """
        if self.base is not None:
            return self.tag_inventory.saved_layout.lora_base
        if self.fresh_adapters:
            hf_folder = str(self.load_dir) if self.source_format == FORMAT_HF else self.client_state.converted_from
            return LoraBase(str(self.load_dir), self.tag, self.weights_checksum, hf_folder)
        adapter_base = self.hf_source.adapter_base(self.load_dir) if self.source_format == FORMAT_HF else None
        if adapter_base is not None:
            folder = str(adapter_base)
            return LoraBase(folder, None, files_checksum(self.hf_source.files(adapter_base), adapter_base, None), folder)
        return None

    @property
    def client_state(self) -> ClientState:
        """The saved client state (iteration, settings, RNG states) of the chosen tag; all unset for HF dirs."""
        if self.tag_inventory is None or self.tag_inventory.metadata is None:
            return ClientState(format_version=None)
        return self.tag_inventory.metadata.client_state

    def describe(self) -> str:
        if self.nothing_to_load:
            return "\n".join([f"checkpoint: {self.load_dir} holds no complete checkpoint yet and is also the save "
                              "directory; first run of an auto-resuming job, training starts from scratch",
                              *(f"  note:   {note}" for note in self.notes)])
        source = self.tag_dir if self.tag_dir is not None else self.load_dir
        saved_at = f", saved at iteration {self.saved_iteration}" if self.saved_iteration is not None else ""
        if self.base is not None:
            saved_at += f"; LoRA adapters only, over the base {self.base.tag_dir or self.base.load_dir}"
        loaded, fresh = ["LoRA adapters (the tag holds only what trains)" if self.base is not None else
                         "weights" if self.strict else
                         "the weights that match the model (load_module_strict is false; the rest are listed "
                         "when they are loaded)"], []
        if self.load_optimizer:
            loaded += ["optimizer states", "LR schedule position"]
        else:
            fresh += ["optimizer states", "LR schedule (warmup from its first step)"]
        if self.iteration_from_checkpoint:
            position = self.data_position
            loaded += [f"iteration {self.saved_iteration}",
                       f"data position (after iteration {self.saved_iteration}: train sample "
                       f"{position.consumed_train_samples}, validation sample {position.consumed_valid_samples})"]
        else:
            fresh += ["iteration 0", "data position (first sample)"]
        (loaded if self.restore_rng else fresh).append("RNG states")
        if self.fresh_reward_head:
            fresh.append("reward head rm_linear (drawn from the seed; the source is a language model, its output "
                         "layer final_linear is not loaded)")
        if self.fresh_adapters:
            fresh.append("LoRA adapters (A drawn from the seed, B zero; the loaded weights stay frozen)")
        root = self.tag_dir if self.tag_dir is not None else self.load_dir
        files = ", ".join(_relative(p, root) for p in self.files)
        lines = [
            f"checkpoint load plan: {self.mode.value} from {source} (format {self.source_format}{saved_at})",
            f"  loaded: {', '.join(loaded)}",
            f"  fresh:  {', '.join(fresh) or 'nothing'}",
            f"  reads:  {files}",
        ]
        if self.base is not None:
            base = self.base.tag_dir or self.base.load_dir
            lines.insert(1, f"  base:   frozen weights from {base} (format {self.base.source_format}), recorded by the "
                            f"adapter-only tag, checksum {self.tag_inventory.saved_layout.lora_base.checksum} checked; "
                            f"reads {', '.join(_relative(p, base) for p in self.base.files)}")
        if self.model:
            lines.insert(1, f"  model:  {self.model}")
        lines += [f"  note:   {note}" for note in self.notes]
        return "\n".join(lines)


def _relative(path: Path, root: Path) -> str:
    try:
        return str(path.relative_to(root))
    except ValueError:
        return str(path)


def recorded_weights_plan(settings: LoadSettings, recorded: ReferenceIdentity, where: str, way_out: str,
                          data_parallel_size: int, hf_source: WeightsSource | None) -> LoadPlan:
    """The module-only plan of weights a save recorded (`recorded`: a DPO/KTO reference, a LoRA run's base);
    CheckpointError in one line, `where` naming them, when they are gone, unloadable or changed."""
    if not recorded.path.exists():
        raise CheckpointError(f"{where}, is gone. {way_out}")
    iteration = layout.iteration_of_tag(recorded.tag) if recorded.tag else None
    weights = settings.weights_only(where, load=recorded.source, iteration=iteration)
    try:
        plan = plan_for(weights, inventory_checkpoint(recorded.source, hf_source), data_parallel_size, hf_source)
    except CheckpointError as err:
        raise CheckpointError(f"{where} cannot be loaded: {err}") from None
    checksum = plan.weights_checksum
    if checksum != recorded.checksum:
        raise CheckpointError(f"{where}, changed since the run started: its files' checksum is {checksum}, the run "
                              f"recorded {recorded.checksum}. {way_out}")
    return plan


def lora_base_plan(settings: LoadSettings, tag: TagInventory, data_parallel_size: int,
                   hf_source: WeightsSource | None) -> LoadPlan | None:
    """The module-only plan of the base under an adapter-only tag (the module docstring); None for a full tag."""
    recorded = tag.saved_layout.lora_base
    if recorded is None:
        return None
    if not settings.lora_rank:
        saved = (tag.metadata.saved_args or {}).get("lora_rank")
        raise CheckpointError(
            f"{tag.path} holds LoRA adapters only (over the base {recorded.path}), but this run has no adapters "
            f"(lora_rank 0). Set the lora_* settings of the run that saved it (lora_rank {saved}).")
    return recorded_weights_plan(
        settings, recorded, f"the base model of the LoRA adapters in {tag.path}, {recorded.path}", "The adapters were "
        "trained over exactly those weights: restore them at that path.", data_parallel_size, hf_source)


def schedule_start(mode: LoadMode, saved_iteration: int | None, client: ClientState) -> int:
    """The iteration the LR schedule counts from after a load: a full resume continues the saved schedule;
    a fresh optimizer starts a fresh schedule (warmup included) at the iteration the run continues from."""
    if mode is LoadMode.RESUME:
        return client.lr_schedule_start
    return int(saved_iteration or 0) if mode is LoadMode.NO_LOAD_OPTIM else 0


def _contract(settings: LoadSettings) -> dict:
    """What a load takes from the settings besides the choice of files."""
    return dict(strict=bool(settings.load_module_strict), allow_random=settings.load_module_allow_random,
                precision=settings.precision, run_architecture=settings.architecture,
                saves_here=layout.same_directory(settings.load, settings.save))


def requested_mode(settings: LoadSettings) -> LoadMode:
    if settings.finetune:
        return LoadMode.FINETUNE
    if settings.no_load_optim:
        return LoadMode.NO_LOAD_OPTIM
    return LoadMode.RESUME


def _saved_without_optimizer(tag: TagInventory) -> bool:
    """The tag was saved with `no_save_optim`: it holds no optimizer states by design, not by loss."""
    settings = tag.metadata.saved_args if tag.metadata is not None else None
    return bool((settings or {}).get("no_save_optim")) and not tag.has_optimizer_states


def _module_files(tag: TagInventory) -> tuple[Path, ...]:
    """The files the module-only path reads for this tag (module_weights.read_module_weights)."""
    if tag.format == FORMAT_PIPELINE:
        return tag.layer_files
    if tag.metadata is not None and tag.metadata.has_module_weights and tag.model_states_files:
        return tuple(tag.model_states_files.values())  # one per tensor-parallel rank
    if tag.zero3_model_states_files and tag.optimizer_files:
        # No full module file: the weights are rebuilt from the ZeRO-3 fp32 partitions.
        return tuple(tag.zero3_model_states_files.values()) + tuple(tag.optimizer_files.values())
    raise CheckpointError(
        f"{tag.path} holds no module weights: no model-states file with a 'module' entry, no pipeline layer "
        f"files, and no complete ZeRO-3 shards (its files: {[p.name for p in tag.files] or 'none'}). "
        "The tag is incomplete; load another tag with `iteration: N`."
    )


def _resume_files(tag: TagInventory, universal: bool) -> tuple[Path, ...]:
    """The files a full resume reads on all ranks together: DeepSpeed's engine.load_checkpoint (its
    _load_checkpoint and _load_zero_checkpoint) and our checks of the module file's names before it.

    The model-states file of each tensor-parallel rank: ``mp_rank_<MP>`` (each rank reads its own), under
    ZeRO-3 ``zero_pp_rank_<DP>_mp_rank_<MP>`` plus the full module file we add, which the name checks read.
    Under ZeRO 1-3 the optimizer shards (each data-parallel rank reads its own); under stage 0 the optimizer
    sits in the model-states file, and DeepSpeed never reads the shards a bf16 optimizer writes beside it.
    A universal load reads the optimizer from the ``zero/`` folder instead of the shards.
    """
    stage = tag.metadata.zero_stage if tag.metadata is not None else 0
    files = [*tag.model_states_files.values(), *tag.layer_files]
    if stage == 3:  # a universal load reads data-parallel rank 0's only: the optimizer comes from zero/
        files += (path for (dp, _), path in tag.zero3_model_states_files.items() if dp == 0 or not universal)
    if universal:
        files += (path for path in (tag.path / layout.UNIVERSAL_DIR).rglob("*") if path.is_file())
    elif stage > 0:
        files += tag.optimizer_files.values()
    return tuple(sorted(files))


def _rng_decision(no_load_rng: bool, mode: LoadMode, tag: TagInventory, world_size: int) -> tuple[bool, list[str]]:
    if mode is LoadMode.FINETUNE:
        return False, []
    if no_load_rng:
        return False, ["RNG states not restored: no_load_rng is set"]
    saved = tag.metadata.client_state.rng_states if tag.metadata else None
    if not saved:
        return False, [f"RNG states not restored: {tag.path} holds none (saved by another program)"]
    if len(saved) != world_size:
        return False, [f"RNG states not restored: saved by {len(saved)} ranks, this run has {world_size}"]
    return True, []


def _hf_plan(settings: LoadSettings, inventory: CheckpointInventory, mode: LoadMode) -> LoadPlan:
    root = inventory.root
    if mode is not LoadMode.FINETUNE or settings.iteration is not None:
        raise CheckpointError(
            f"`load: {root}` is a Hugging Face model folder: it holds weights only, no optimizer states, "
            "iteration or RNG states. Set `finetune: true` (and leave `iteration` unset) to start from its weights."
        )
    source = inventory.hf_source
    source.check_architecture(root, settings.architecture())
    source.check_adapters(root, settings.lora, settings.source_of)
    adapter_base = source.adapter_base(root)
    unchecked = f"no {layout.MANIFEST_FILE} in a Hugging Face folder: its files are not checksummed"
    adapters = [] if adapter_base is None else [f"LoRA adapters of PEFT's folder {root} over their base model "
                                                f"{adapter_base}, both loaded", _peft_base_checked(root, adapter_base,
                                                                                                    source)]
    return LoadPlan(mode=mode, load_dir=root, source_format=FORMAT_HF, **_contract(settings),
                    files=inventory.hf_files, hf_source=source, model=_model(settings),
                    notes=(*_model_from_checkpoint_note(settings.sources, root), *adapters, unchecked),
                    fresh_reward_head=settings.train_impl == "rm" and not source.is_reward_model(root),
                    fresh_adapters=settings.lora_rank > 0 and adapter_base is None)


def _peft_base_checked(root: Path, base: Path, source: WeightsSource) -> str:
    """The note on the base under a PEFT folder's adapters, checked against the record its export wrote beside
    them (identity.LORA_BASE_FILE); CheckpointError in one line when the base changed since."""
    recorded = read_lora_base_file(root)
    if recorded is None:
        return (f"no {LORA_BASE_FILE} beside {root / 'adapter_config.json'} (a PEFT folder written elsewhere): its "
                f"base {base} cannot be verified to be the model the adapters were trained over")
    checksum = files_checksum(source.files(base), base, None)
    if checksum != recorded.checksum:
        raise CheckpointError(
            f"{root / LORA_BASE_FILE}: the adapters were trained over a base whose files' checksum is "
            f"{recorded.checksum} ({recorded.source}), but their base {base} now gives {checksum}: the base model "
            "changed under the adapters. Restore the base they were trained over, or point base_model_name_or_path "
            "in adapter_config.json at a copy of it")
    return f"base {base} checked against {root / LORA_BASE_FILE}: the model the adapters were trained over"


def _model(settings: LoadSettings) -> str | None:
    """The model's family and variants; None before the settings describe a whole model (no padded_vocab_size
    yet: the compatibility checks say what is missing when it matters)."""
    try:
        return describe_model(settings.architecture(), settings.hf_model_type)
    except ModelConfigError:
        return None


def _model_from_checkpoint_note(sources: dict[str, str], root: Path) -> list[str]:
    """Which settings came from the checkpoint itself (megatron.launch.run_context.settings_for_run)."""
    taken = [name for name, source in sources.items() if str(source).startswith(str(root))]
    if not taken:
        return []
    return [f"model settings taken from {sources[taken[0]]}, as no config file sets them: {', '.join(taken)}"]


def _check_iterations_left(plan: LoadPlan, settings: LoadSettings) -> None:
    """A run that continues the checkpoint's iteration count must have steps left to train."""
    if not plan.iteration_from_checkpoint or settings.train_iters is None or plan.saved_iteration is None:
        return
    if settings.train_iters <= plan.saved_iteration:
        raise CheckpointError(
            f"{settings.source_of('train_iters')}: train_iters is {settings.train_iters}, but {plan.tag_dir} was saved at "
            f"iteration {plan.saved_iteration}, so there is nothing left to train. Raise train_iters above "
            f"{plan.saved_iteration} to train further, load an earlier tag with `iteration: N`, or set "
            "`finetune: true` to train its weights from iteration 0."
        )


def _skipped_notes(inventory: CheckpointInventory) -> list[str]:
    if not inventory.partial_tags:
        return []
    return [f"skipped {', '.join(inventory.partial_tags)}: interrupted save(s), never loaded; the next save removes them"]


def build_load_plan(args, inventory: CheckpointInventory, data_parallel_size: int,
                    hf_source: WeightsSource | None = None) -> LoadPlan:
    """`plan_for` with the load settings of the run's settings `args`."""
    return plan_for(LoadSettings.from_args(args), inventory, data_parallel_size, hf_source)


def plan_for(settings: LoadSettings, inventory: CheckpointInventory, data_parallel_size: int,
             hf_source: WeightsSource | None = None) -> LoadPlan:
    """Decide what to load from `inventory` for these settings; CheckpointError when it cannot be done.
    `hf_source` reads the base of an adapter-only tag when that is a Hugging Face folder."""
    mode = requested_mode(settings)
    root = inventory.root
    if inventory.is_hf:
        return _hf_plan(settings, inventory, mode)
    skipped = _skipped_notes(inventory)
    first_run = _first_run(settings, inventory, mode, skipped)
    if first_run is not None:
        return first_run
    tag = _complete_tag(inventory, settings.iteration)
    has_manifest = tag.manifest is not None  # refuses a damaged, empty or incomplete one
    fresh_optimizer = []
    if mode is LoadMode.RESUME and _saved_without_optimizer(tag):
        mode = LoadMode.NO_LOAD_OPTIM
        fresh_optimizer.append(f"optimizer starts fresh: {tag.path} was saved with no_save_optim (weights only), "
                               "so this resume loads as with no_load_optim")
    load_optimizer = mode is LoadMode.RESUME
    universal = preflight.loads_universal(tag, settings.deepspeed_extra_args)
    layout_change = shape.layout_change(tag, settings, data_parallel_size,
                                        load_optimizer and tag.metadata is not None and not universal)
    files = _files_read(tag, layout_change, load_optimizer, universal)
    world_size = (data_parallel_size * max(settings.model_parallel_size or 1, 1)
                  * max(settings.pipe_parallel_size or 1, 1))
    restore_rng, rng_notes = _rng_decision(settings.no_load_rng, mode, tag, world_size)
    client = tag.metadata.client_state if tag.metadata else ClientState(format_version=None)
    client.check_readable(tag.metadata_file)
    saved_iteration = _saved_iteration(tag, client, mode)
    position = data_position(client, saved_iteration, settings.position) if mode is not LoadMode.FINETUNE else None
    notes = [*(layout_change.resume.notes() if layout_change.resume else ()), *fresh_optimizer, *rng_notes]
    if position is not None:
        notes += [*position.notes, *resume_change_notes(settings.position, client, tag.tag, tag.iteration, position)]
    notes += _layout_notes(tag, layout_change, load_optimizer, has_manifest) + skipped
    plan = LoadPlan(
        mode=mode,
        load_dir=root,
        tag=tag.tag,
        tag_dir=tag.path,
        source_format=tag.format,
        saved_iteration=saved_iteration,
        load_optimizer=load_optimizer,
        iteration_from_checkpoint=mode is not LoadMode.FINETUNE,
        restore_rng=restore_rng,
        data_position=position,
        files=files,
        notes=tuple(_model_from_checkpoint_note(settings.sources, root) + notes),
        **_contract(settings),
        layout_change=layout_change,
        validate_forward=bool(settings.checkpoint_validation_with_forward_pass),
        lr_schedule_start=schedule_start(mode, saved_iteration, client),
        tag_inventory=tag,
        model=_model(settings),
        fresh_reward_head=_fresh_reward_head(settings.train_impl, client, tag, load_optimizer),
        fresh_adapters=_fresh_adapters(settings.lora_rank, client, tag, load_optimizer),
        base=lora_base_plan(settings, tag, data_parallel_size, hf_source),
    )
    _check_iterations_left(plan, settings)
    preflight.check_plan(files, load_optimizer, tag, settings, layout_change)
    return plan


def _first_run(settings: LoadSettings, inventory: CheckpointInventory, mode: LoadMode, skipped: list[str]) -> LoadPlan | None:
    """The plan of an auto-resuming job's first run (nothing to load yet), None where there is a checkpoint to
    load; CheckpointError where `load` names no checkpoint and the run does not save there."""
    root = inventory.root
    auto_resume = (layout.same_directory(settings.load, settings.save) and mode is LoadMode.RESUME
                   and settings.iteration is None)
    if auto_resume and inventory.latest is None and inventory.tags and all(
            tag.format == FORMAT_INCOMPLETE for tag in inventory.tags.values()):
        skipped.append(f"skipped {', '.join(inventory.tags)}: incomplete (no model-states file) and not named by "
                       f"`{layout.LATEST_FILE}`")
        return LoadPlan(mode=LoadMode.FIRST_RUN, load_dir=root, notes=tuple(skipped))
    if inventory.exists and not inventory.is_empty:
        return None
    if auto_resume:
        return LoadPlan(mode=LoadMode.FIRST_RUN, load_dir=root, notes=tuple(skipped))
    if root.is_file():
        where = f"{root} is a file, not a checkpoint directory"
    elif not inventory.exists:
        where = f"{root} does not exist"
    else:
        where = f"{root} holds no checkpoint (no global_step<N> folders, no `{layout.LATEST_FILE}` file)"
    raise CheckpointError(
        f"`load: {settings.load}` is set but {where}. Fix the path; unset `load` to train from scratch; "
        "or set `load` and `save` to the same directory to resume automatically when a checkpoint exists."
    )


def _complete_tag(inventory: CheckpointInventory, iteration: int | None) -> TagInventory:
    tag = inventory.chosen_tag(iteration=iteration)
    if tag.format == FORMAT_INCOMPLETE:
        raise CheckpointError(
            f"{tag.path} is incomplete: it holds no model-states file ({layout.model_states_name(0)}, "
            f"{layout.zero3_model_states_name(0, 0)}) and no pipeline layer files (an interrupted save?). "
            f"{inventory.available()}; pick another with `iteration: N`."
        )
    return tag


def _saved_iteration(tag: TagInventory, client: ClientState, mode: LoadMode) -> int | None:
    saved_iteration = next((value for value in (client.iteration, tag.iteration,
                                                 tag.metadata.global_steps if tag.metadata else None)
                            if value is not None), None)
    if saved_iteration is None and mode is not LoadMode.FINETUNE:
        raise CheckpointError(
            f"{tag.path} records no iteration (no 'iteration' in its client state, no DeepSpeed step count, "
            "and the tag is not named global_step<N>), so training cannot continue from it. Set `finetune: true` to start at iteration 0 "
            "from its weights."
        )
    return saved_iteration


def _files_read(tag: TagInventory, change: shape.LayoutChange, load_optimizer: bool, universal: bool) -> tuple[Path, ...]:
    if change.resume is not None:
        return shape.files_read(tag)
    if load_optimizer:
        return _resume_files(tag, universal)
    return tuple(dict.fromkeys((*filter(None, [tag.metadata_file]), *_module_files(tag))))


def _layout_notes(tag: TagInventory, change: shape.LayoutChange, load_optimizer: bool, has_manifest: bool) -> list[str]:
    notes = []
    if tag.format == FORMAT_ZERO3 and not load_optimizer:
        notes.append("no full module file: weights are rebuilt from the ZeRO-3 fp32 partitions")
    notes += change.resplit_notes(load_optimizer)
    notes.append(f"files checked against {layout.MANIFEST_FILE} (it lists every file of the tag) before they are read"
                 if has_manifest else
                 f"no {layout.MANIFEST_FILE} (saved by another program or an older version): files are not checksummed")
    return notes


def _fresh_reward_head(train_impl: str, client: ClientState, tag: TagInventory, load_optimizer: bool) -> bool:
    """Whether a reward-model run starts its head fresh from this tag (the module docstring)."""
    saved_rm = (client.settings or {}).get("train_impl") == "rm"
    if train_impl != "rm" or saved_rm:
        return False
    if load_optimizer:
        raise CheckpointError(
            f"{tag.path} is a language model's checkpoint (train_impl {(client.settings or {}).get('train_impl')!r}), "
            "not a reward model's, so a full resume cannot restore a reward model from it; set `finetune: true` "
            "to start the reward model from its weights with a fresh head")
    return True


def _fresh_adapters(lora_rank: int, client: ClientState, tag: TagInventory, load_optimizer: bool) -> bool:
    """Whether a LoRA run starts its adapters fresh over this tag's weights (the module docstring)."""
    if not lora_rank or (client.settings or {}).get("lora_rank"):
        return False
    if load_optimizer:
        raise CheckpointError(
            f"{tag.path} was saved without LoRA adapters (lora_rank 0), so a full resume cannot restore a LoRA run "
            "from it; set `finetune: true` to train fresh adapters over its weights")
    return True


def plan_load(args, data_parallel_size: int, hf_source: WeightsSource | None = None) -> LoadPlan | None:
    """`plan_load_for` with the load settings of the run's settings `args`."""
    return plan_load_for(LoadSettings.from_args(args), data_parallel_size, hf_source)


def plan_load_for(settings: LoadSettings, data_parallel_size: int,
                  hf_source: WeightsSource | None = None) -> LoadPlan | None:
    """Inspect `settings.load` and decide what to load; call before deepspeed.initialize so bad loads fail fast.

    None when `load` is unset. Raises CheckpointError when the plan cannot be carried out. With
    `hf_source` (megatron.hf.HF_FOLDER) `load` may name a Hugging Face model folder.
    """
    if not settings.load:
        return None
    plan = plan_for(settings, inventory_checkpoint(settings.load, hf_source), data_parallel_size, hf_source)
    from megatron.logging import get_logger

    get_logger().info(plan.describe())
    return plan
