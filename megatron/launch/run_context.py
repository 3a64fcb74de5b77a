"""The settings that depend on files, resolved once, before any rank starts (deepy.py calls both steps).

`settings_for_run` validates the config files, taking the model from the checkpoint named by `load`
when the files do not give its shape. `resolve_run_settings` then resolves what files decide:
`embedded_corpus: true` points data_path, vocab_file and tokenizer_type at the embedded corpus
(built once and cached); the tokenizer gives padded_vocab_size. Both go through validation again
(`NeoXArgs.with_values`), and every rank receives the complete, read-only result: no rank changes a
setting, and every rank has the very same ones. The corpus and the tokenizer file must therefore be
readable where deepy.py runs (and, on several nodes, at the same path on each: a shared filesystem).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megatron.neox_arguments import SETTINGS, ConfigError, NeoXArgs, padded_vocab_size
from megatron.neox_arguments.arguments import COMMAND_LINE_SOURCE
from megatron.neox_arguments.derived import EMBEDDED_CORPUS_SOURCE, MODEL_REQUIRED
from megatron.neox_arguments.yaml_files import merge_config_files


def resolve_run_settings(args: NeoXArgs) -> NeoXArgs:
    """`args` with the embedded corpus and padded_vocab_size resolved; unchanged when already resolved."""
    from megatron.tokenizer import TokenizerError, build_tokenizer

    if args.embedded_corpus and args.source_of("data_path") != EMBEDDED_CORPUS_SOURCE:
        from megatron.data.embedded_corpus import ensure_embedded_corpus

        corpus = ensure_embedded_corpus()
        args = args.with_values({"data_path": corpus.data_prefix, "vocab_file": corpus.vocab_file,
                                 "tokenizer_type": "HFTokenizer"}, EMBEDDED_CORPUS_SOURCE)
    if args.padded_vocab_size is not None:
        return args
    try:
        tokenizer = build_tokenizer(args)
    except TokenizerError as err:
        raise ConfigError(f"tokenizer_type / vocab_file: {err}") from None
    padded = padded_vocab_size(tokenizer.vocab_size, args.make_vocab_size_divisible_by, args.model_parallel_size)
    return args.with_values({"padded_vocab_size": padded},
                            f"tokenizer {args.vocab_file or args.tokenizer_type} ({tokenizer.vocab_size} tokens)")


def check_run_files(args: NeoXArgs) -> None:
    """For deepy.py --dry-run: the checks megatron.training.loop.setup makes of the data files a training run names,
    made by the same functions without building sample indices (check_data_files; precomputed_reference for the precomputed log-probabilities'
    model), so a dry run refuses what the start would. Nothing to check for generate.py / eval.py settings, or
    for the embedded corpus, which this framework writes itself."""
    from megatron.checkpointing import LoadSettings, plan_load_for
    from megatron.data.builders import check_data_files, samples_per_split
    from megatron.data.data_settings import DataSettings
    from megatron.hf import HF_FOLDER
    from megatron.objectives.precomputed_reference import (
        PrecomputeSettings,
        precomputed_reference,
        uses_precomputed_reference,
    )
    from megatron.tokenizer import build_tokenizer

    if not args.requires_run_settings or args.embedded_corpus:
        return
    args = resolve_run_settings(args)
    data_settings = DataSettings.from_args(args)
    check_data_files(data_settings, build_tokenizer(args).vocab_size, samples_per_split(data_settings))
    precompute = PrecomputeSettings.from_args(args)
    if uses_precomputed_reference(precompute):
        load_settings = LoadSettings.from_args(args)
        plan = plan_load_for(load_settings, args.data_parallel_size, hf_source=HF_FOLDER)
        precomputed_reference(precompute, load_settings, plan, args.data_parallel_size, hf_source=HF_FOLDER)


# What a run that names a checkpoint but not the model's shape takes from the checkpoint: every
# setting of the model (the architecture and its vocabulary padding) and the tokenizer.
TOKENIZER_SETTINGS = ("tokenizer_type", "vocab_file", "merge_file")


def settings_for_run(paths: list[str], command_line: dict[str, Any] | None = None) -> NeoXArgs:
    """The validated settings of the config files; the model from the checkpoint when the files omit its shape.

    With `load` set and a model-shape setting (num_layers, hidden_size, ...) in no file, every model
    and tokenizer setting that no file sets comes from the settings the checkpoint recorded (or an
    HF folder's config.json); a setting a file does set is compared with the checkpoint by the load plan.
    `command_line` (deepy.py's --eval_tasks, --iteration, ...) wins over every file.
    """
    files = merge_config_files(paths)
    given = {**files.values, **(command_line or {})}
    _check_no_tokenizer_beside_the_embedded_corpus(given, files.sources)
    load = given.get("load")
    adapters = _peft_folder(Path(load).expanduser()) if load else None
    if adapters is not None:
        return _settings_over_adapters(paths, command_line, given, files.sources, adapters)
    if not load or all(given.get(name) is not None for name in MODEL_REQUIRED):
        return NeoXArgs.from_yaml_files(paths, overlay=command_line)
    saved, source = _checkpoint_model_settings(Path(load).expanduser(), given.get("iteration"),
                                               given.get("model_parallel_size") or 1)
    return NeoXArgs.from_yaml_files(paths, underlay=saved, underlay_source=source, overlay=command_line)


def _check_no_tokenizer_beside_the_embedded_corpus(given: dict[str, Any], sources: dict[str, str]) -> None:
    """The embedded corpus is tokenized with its own tokenizer, which replaces any a config file names."""
    if not given.get("embedded_corpus"):
        return
    for name in TOKENIZER_SETTINGS:
        if given.get(name) is not None:
            raise ConfigError(
                f"{sources.get(name, 'the command line')}: {name} is set, but {sources.get('embedded_corpus')}: "
                "embedded_corpus trains on the embedded corpus, which brings its own tokenizer; remove "
                f"{name}, or set embedded_corpus: false and data_path to data tokenized with it")


def _peft_folder(load: Path):
    """The PEFT adapter folder `load` names, read and checked; None when it names none."""
    from megatron.hf.errors import HFConversionError
    from megatron.hf.io import is_peft_dir

    if not is_peft_dir(load):
        return None
    from megatron.hf.peft import read_peft_folder

    try:
        return read_peft_folder(load)
    except HFConversionError as err:
        raise ConfigError(f"load: {err}") from None


def _settings_over_adapters(paths: list[str], command_line: dict[str, Any] | None, given: dict[str, Any],
                            sources: dict[str, str], adapters) -> NeoXArgs:
    """A run that starts from a PEFT adapter folder: the lora_* settings no file sets come from its
    adapter_config.json (one that a file sets differently is refused), the model from its base's config.json
    when no file gives the model's shape."""
    from megatron.hf.errors import HFConversionError
    from megatron.hf.peft import check_run_lora

    try:
        if given.get("lora_rank") == 0:  # the folder's other lora_* settings would be refused as doing nothing
            check_run_lora(adapters, None, lambda name: sources.get(name, COMMAND_LINE_SOURCE))
        model, model_source = {}, ""
        if not all(given.get(name) is not None for name in MODEL_REQUIRED):
            model, model_source = _hf_model_settings(adapters.base_folder(), given.get("model_parallel_size") or 1)
        underlay_sources = {**dict.fromkeys(model, model_source),
                            **dict.fromkeys(adapters.settings, str(adapters.config_file))}
        args = NeoXArgs.from_yaml_files(paths, underlay={**model, **adapters.settings},
                                        underlay_source=underlay_sources, overlay=command_line)
        check_run_lora(adapters, args.lora(), args.source_of)
    except HFConversionError as err:
        raise ConfigError(str(err)) from None
    return args


def _checkpoint_model_settings(load: Path, iteration: int | None, tensor_parallel: int) -> tuple[dict[str, Any], str]:
    from megatron.checkpointing import CheckpointError, inventory_checkpoint
    from megatron.hf import HF_FOLDER

    inventory = inventory_checkpoint(load, HF_FOLDER)
    if inventory.is_hf:
        return _hf_model_settings(load, tensor_parallel)
    try:  # the tag's model-states file: checked against its manifest, unpickled weights-only
        tag = inventory.chosen_tag(iteration=iteration)
        settings = tag.metadata.saved_args if tag.metadata is not None else None
    except CheckpointError as err:
        raise ConfigError(f"load: {err}") from None
    if not settings:
        raise ConfigError(
            f"the config files do not give the model's shape ({', '.join(MODEL_REQUIRED)}) and {tag.path} records "
            "no settings to take it from; add the model's settings (e.g. the checkpoint's configs/*.yml) to the "
            "command line"
        )
    model = NeoXArgs.from_saved(settings, str(tag.path))
    # How the saving run split the model is not part of it: a module-only load re-splits the weights
    # for this run's model_parallel_size and pipeline stages (context parallelism splits no weight), and a full resume at another size is
    # refused with the way out.
    split = ("model_parallel_size", "context_parallel_size", "pipe_parallel_size", "pipe_partition_method")
    names = [name for name, setting in SETTINGS.items() if setting.group == "model" and name not in split]
    taken = {name: getattr(model, name) for name in names if model.source_of(name) == str(tag.path)}
    taken.update({name: settings[name] for name in TOKENIZER_SETTINGS if settings.get(name) is not None})
    return taken, f"{tag.path} (saved settings)"


def _hf_model_settings(hf_dir: Path, tensor_parallel: int) -> tuple[dict[str, Any], str]:
    from megatron.hf.config import spec_from_hf_config
    from megatron.hf.errors import HFConversionError
    from megatron.hf.io import TOKENIZER_NAME, read_hf_config

    try:
        spec = spec_from_hf_config(read_hf_config(hf_dir), str(hf_dir / "config.json"))
    except HFConversionError as err:
        raise ConfigError(str(err)) from None
    # Padding to exactly the folder's vocab_size keeps its embedding shape for any tokenizer that fits
    # (the padding multiple is per tensor-parallel rank: each holds its share of the rows).
    per_rank = spec.vocab_size // tensor_parallel if spec.vocab_size % tensor_parallel == 0 else spec.vocab_size
    taken = {**spec.settings, "make_vocab_size_divisible_by": per_rank}
    if (hf_dir / TOKENIZER_NAME).is_file():
        taken.update(tokenizer_type="HFTokenizer", vocab_file=str((hf_dir / TOKENIZER_NAME).resolve()))
    return taken, str(hf_dir / "config.json")
