"""Whole-directory conversions: an HF model folder -> a module-only checkpoint of ours, and back."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import deepspeed
import torch
import yaml

from megatron.checkpointing import (
    CheckpointError,
    ClientState,
    LoadSettings,
    LoraBase,
    TagInventory,
    files_checksum,
    inventory_checkpoint,
    layer_file_name,
    layer_states,
    lora_base_plan,
    model_states_name,
    read_full_module_weights,
    read_module_weights,
    tag_for_iteration,
    write_lora_base_file,
    write_tag,
)
from megatron.contract.architecture import Architecture, ModelConfigError, implied_family
from megatron.contract.lora_settings import LORA_SETTINGS, LoraSettings, lora_settings
from megatron.fsio import write_atomically, write_text_atomically
from megatron.hf.config import (
    FAMILIES,
    architecture_of,
    hf_config_from_architecture,
    unrepresentable,
)
from megatron.hf.errors import HFConversionError
from megatron.hf.folder_weights import HF_FOLDER, check_hf_settings, read_hf_model
from megatron.hf.io import DEFAULT_MAX_SHARD_BYTES, TOKENIZER_NAME, is_hf_model_dir, write_hf_dir
from megatron.hf.mapping import convert_tensors, ours_to_hf
from megatron.hf.output_folder import check_output_apart, check_output_folder, staged_output
from megatron.hf.peft import (
    SIDES,
    adapter_config,
    expert_layers,
    merge_into,
    our_layout,
    peft_layout,
    peft_names,
    write_peft_dir,
)
from megatron.model.gpt_model import layer_key
from megatron.model.lora import ExpertAdapter
from megatron.model.moe import with_expert_deltas
from megatron.model.partitioning import partition, partitioning
from megatron.neox_arguments import SETTINGS, NeoXArgs
from megatron.neox_arguments.derived import tensor_parallel_split_problem
from megatron.neox_arguments.yaml_files import merge_config_files
from megatron.tokenizer import EOD_TOKEN, PAD_TOKEN

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
HF_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
CONVERTED_TAG = tag_for_iteration(0)


def _save(path: Path, state: dict) -> None:
    write_atomically(path, lambda tmp: torch.save(state, tmp))


@dataclass(frozen=True)
class ConvertedCheckpoint:
    tag_dir: Path
    settings: dict[str, Any]  # architecture (and tokenizer) settings that reproduce the model
    config_path: Path | None


def _yaml_settings(spec_settings: dict[str, Any], vocab_size: int, tokenizer: Path | None) -> dict[str, Any]:
    settings = {k: v for k, v in spec_settings.items() if v is not None}
    # padded_vocab_size is derived from the tokenizer, padded to a multiple of this: padding to
    # exactly the HF vocab_size keeps the embedding shape for any tokenizer of at most that many tokens.
    settings["make_vocab_size_divisible_by"] = vocab_size
    if tokenizer is not None:
        settings.update(tokenizer_type="HFTokenizer", vocab_file=str(tokenizer.resolve()))
    return settings


def convert_hf_to_neox(
    hf_dir: Path,
    out_dir: Path,
    dtype: str = "fp32",
    config_out: Path | None = None,
    progress: bool = False,
    model_parallel_size: int = 1,
    pipe_parallel_size: int = 0,
    overwrite: bool = False,
) -> ConvertedCheckpoint:
    """Write ``out_dir/latest`` and ``out_dir/global_step0/mp_rank_<MP>_model_states.pt``, one per
    tensor-parallel rank of ``model_parallel_size`` (module only). With ``pipe_parallel_size`` >= 1
    (GPT-NeoX's meaning: a pipe module, whose weights are layer files) the weights go into
    ``layer_<II>-model_<MP>-model_states.pt`` instead, and the mp_rank files, one per (stage,
    tensor-parallel rank) as DeepSpeed's pipe engine numbers them, hold the client state only.
    An ``out_dir`` or ``config_out`` that holds a model or a run is refused unless ``overwrite``."""
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    if dtype not in DTYPES:
        raise HFConversionError(f"dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}")
    check_output_folder(out_dir, [hf_dir], overwrite)
    if config_out is not None:
        check_output_apart(config_out, [hf_dir], "--config-out")
    if config_out is not None and Path(config_out).exists() and not overwrite:
        raise HFConversionError(f"--config-out {config_out} exists; choose a new file, or pass --overwrite to replace it")
    spec, module = read_hf_model(hf_dir, DTYPES[dtype], progress)
    arch = spec.architecture()
    problem = tensor_parallel_split_problem(model_parallel_size, arch.num_attention_heads, arch.num_kv_heads,
                                            arch.intermediate_size)
    if problem is None and spec.vocab_size % model_parallel_size:
        problem = f"vocab_size={spec.vocab_size} is not divisible by model_parallel_size={model_parallel_size}"
    if problem:
        raise HFConversionError(f"{hf_dir} cannot be split for --model-parallel-size {model_parallel_size}: {problem}")
    has_tokenizer = (hf_dir / TOKENIZER_NAME).is_file()
    settings = _yaml_settings(spec.settings, spec.vocab_size, out_dir / TOKENIZER_NAME if has_tokenizer else None)
    client_state = ClientState(
        iteration=0,
        consumed_train_samples=0,
        settings={**settings, "padded_vocab_size": spec.vocab_size, "precision": dtype,
                  "model_parallel_size": model_parallel_size, "pipe_parallel_size": pipe_parallel_size},
        converted_from=str(hf_dir.resolve()),
    )
    with staged_output(out_dir) as staging:
        if has_tokenizer:
            shutil.copyfile(hf_dir / TOKENIZER_NAME, staging / TOKENIZER_NAME)
        write_tag(staging, CONVERTED_TAG, 0, lambda partial: _write_module_only_tag(
            partial, module, arch, client_state, model_parallel_size, pipe_parallel_size))
    if config_out is not None:
        config_out = Path(config_out)
        header = (
            f"# Architecture of {hf_dir.resolve()} ({spec.family}), written by convert_hf_to_neox.py.\n"
            f"# Fine-tune from it with `load: {out_dir.resolve()}` and `finetune: true`.\n"
        )
        write_text_atomically(config_out, header + yaml.safe_dump(settings, sort_keys=False))
    return ConvertedCheckpoint(out_dir / CONVERTED_TAG, settings, config_out)


def _write_module_only_tag(tag_dir: Path, module: dict[str, torch.Tensor], arch: Architecture, client_state: ClientState,
                           model_parallel_size: int, pipe_parallel_size: int) -> None:
    for mp in range(model_parallel_size):
        weights = {name: partition(value, partitioning(name, arch), mp, model_parallel_size).clone()
                   for name, value in module.items()}
        if pipe_parallel_size >= 1:
            for position, layer in layer_states(weights).items():
                _save(tag_dir / layer_file_name(position, mp), layer)
        state = {
            "module": weights if pipe_parallel_size < 1 else None,
            "buffer_names": [],
            "optimizer": None,
            "lr_scheduler": None,
            "global_steps": 0,
            "global_samples": 0,
            "skipped_steps": 0,
            "dp_world_size": 1,
            "mp_world_size": model_parallel_size,
            "ds_version": deepspeed.__version__,
            **client_state.to_dict(),
        }
        for stage in range(max(pipe_parallel_size, 1)):
            _save(tag_dir / model_states_name(stage * model_parallel_size + mp), state)


def special_tokens(tokenizer_file: Path) -> dict[str, tuple[str, int]]:
    """GPT-NeoX's end-of-document and padding tokens as HF's bos/eos/pad, where the tokenizer has them."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    roles = {"bos_token": EOD_TOKEN, "eos_token": EOD_TOKEN, "pad_token": PAD_TOKEN}
    found = {role: (token, tokenizer.token_to_id(token)) for role, token in roles.items()}
    return {role: pair for role, pair in found.items() if pair[1] is not None}


def _token_of(tokenizer_file: Path, token_id: int, where: Path) -> str:
    from tokenizers import Tokenizer

    token = Tokenizer.from_file(str(tokenizer_file)).id_to_token(token_id)
    if token is None:
        raise HFConversionError(f"{where}: pad token id {token_id} is not a token of {tokenizer_file}; "
                                "pass the id of one of its tokens")
    return token


def _settings_of_checkpoint(tag: TagInventory, config_files: list[Path] | None) -> dict[str, Any]:
    if config_files:
        return dict(merge_config_files(list(config_files)).values)
    try:
        args = tag.metadata.saved_args if tag.metadata is not None else None  # pipeline tags: maybe layer files only
    except CheckpointError:
        args = None
    if args is None:
        raise HFConversionError(
            f"{tag.path} holds no saved settings (client state `args`); pass the run's YAML files with --config"
        )
    return args


def convert_neox_to_hf(
    ckpt_dir: Path,
    out_dir: Path,
    tag: str | None = None,
    architecture: str | None = None,
    config_files: list[Path] | None = None,
    dtype: str | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    progress: bool = False,
    save_tokenizer: bool = True,
    pad_token_id: int | None = None,
    overwrite: bool = False,
    peft: bool = False,
    base_model: Path | None = None,
) -> Path:
    """Write an HF model folder for tag ``tag`` (default: the one in ``latest``) of our checkpoint.

    The run's tokenizer (a `tokenizers` JSON vocab_file) is written with it unless ``save_tokenizer`` is
    false; ``pad_token_id`` names the padding token instead of GPT-NeoX's <|padding|> (GPT-NeoX's
    converter's --pad-token-id). An ``out_dir`` that holds a model or a run is refused unless ``overwrite``.

    A tag with LoRA adapters is written merged (W + scaling B A, computed in fp32, then cast to the export
    dtype), or with ``peft`` as a PEFT adapter folder over ``base_model`` (default: the Hugging Face folder
    the run's base came from, when the tag records one)."""
    ckpt_dir = Path(ckpt_dir)
    check_output_folder(Path(out_dir), [ckpt_dir], overwrite)
    tag_inventory = inventory_checkpoint(ckpt_dir).chosen_tag(tag=tag, pick_with="--tag {tag}")
    tag_dir = tag_inventory.path
    tp_size = tag_inventory.saved_layout.tensor_parallel
    first_part = read_module_weights(tag_dir)
    settings = _settings_of_checkpoint(tag_inventory, config_files)
    check_output_folder(Path(out_dir), _export_inputs(ckpt_dir, tag_inventory, settings, config_files, base_model),
                        overwrite)
    adapters_only = tag_inventory.saved_layout.adapters_only
    embedding = first_part.get("sequential.0.word_embeddings.weight")
    if embedding is None and not adapters_only:
        raise HFConversionError(f"{tag_dir}: no sequential.0.word_embeddings.weight; not a checkpoint of this model")
    if settings.get("padded_vocab_size") is None:
        settings["padded_vocab_size"] = embedding.shape[0] * tp_size
    try:  # the whole model: its parts are joined below
        arch = architecture_of({**settings, "model_parallel_size": 1})
    except ModelConfigError as err:  # the model's own check of the settings
        raise HFConversionError(f"{tag_dir}: the saved settings do not describe a valid model: {err}") from None
    module = read_full_module_weights(tag_dir, tp_size, arch)
    family = architecture or settings.get("hf_model_type") or implied_family(arch)
    problems = unrepresentable(arch, family)
    if problems:
        raise HFConversionError(
            f"{tag_dir} cannot be written as Hugging Face {family}: " + "; ".join(problems)
            + f". Supported architectures: {', '.join(FAMILIES)}"
        )
    target = DTYPES[dtype] if dtype else (embedding if embedding is not None else next(iter(first_part.values()))).dtype
    if target not in HF_DTYPE_NAMES:
        raise HFConversionError(f"{tag_dir}: weights in {target}; pass --dtype fp32, bf16 or fp16")
    lora = _lora_of(settings, arch, tag_dir)
    adapters = _adapters_of(module, lora, family, arch, tag_dir)
    if peft:
        return _write_peft_export(Path(out_dir), tag_inventory, lora, arch, base_model,
                                  {name: tensor.to(target) for name, tensor in adapters.items()})
    if adapters_only:
        module = {**_base_weights(tag_inventory, settings, arch), **module}
    if lora is not None and lora.adapts_experts:
        _merge_expert_adapters(module, adapters, lora, family, arch)
    tensors = convert_tensors(module.items(), ours_to_hf(family, arch), str(tag_dir))
    if adapters:
        merge_into(tensors, adapters, lora.scaling)
    for name, tensor in tensors.items():
        tensors[name] = tensor.to(target)
    config = hf_config_from_architecture(arch, family, HF_DTYPE_NAMES[target])
    tokenizer, special = _tokenizer_of(settings, save_tokenizer, pad_token_id, tag_dir, config)
    if arch.reward_head and (config.get("pad_token_id") is None or config["pad_token_id"] == config.get("eos_token_id")):
        raise HFConversionError(
            f"{tag_dir} is a reward model: transformers reads its score at the last token that is not padding, so the "
            f"folder needs a padding token other than eos (pad {config.get('pad_token_id')}, eos "
            f"{config.get('eos_token_id')}); pass --pad-token-id with another token's id")
    with staged_output(Path(out_dir)) as staging:
        write_hf_dir(staging, config, tensors, tokenizer, max_shard_bytes, progress,
                     {role: token for role, (token, _) in special.items()})
    return Path(out_dir)


def _tokenizer_of(settings: dict[str, Any], save_tokenizer: bool, pad_token_id: int | None, tag_dir: Path,
                  config: dict[str, Any]) -> tuple[Path | None, dict[str, tuple[str, int]]]:
    """The run's tokenizer file to write beside the model (a `tokenizers` JSON vocab_file; None when there is none
    or it is not wanted) and its special tokens (role -> (token, id)), whose ids go into ``config``."""
    vocab_file = settings.get("vocab_file")
    if not (save_tokenizer and settings.get("tokenizer_type", "HFTokenizer") == "HFTokenizer" and vocab_file
            and Path(vocab_file).is_file()):
        if pad_token_id is not None:
            config["pad_token_id"] = pad_token_id
        return None, {}
    tokenizer = Path(vocab_file)
    special = special_tokens(tokenizer)
    if pad_token_id is not None:
        special["pad_token"] = (_token_of(tokenizer, pad_token_id, tag_dir), pad_token_id)
    config.update({f"{role}_id": token_id for role, (_, token_id) in special.items()})
    return tokenizer, special


def _lora_of(settings: dict[str, Any], arch: Architecture, tag_dir: Path) -> LoraSettings | None:
    """The LoRA of the saved settings (a lora_* setting they predate at its default); None without."""
    values = {name: settings.get(name, SETTINGS[name].default) for name in LORA_SETTINGS}
    try:
        return lora_settings({**values, "norm": arch.norm, "activation": arch.activation,
                              "moe_num_experts": arch.moe_num_experts})
    except ModelConfigError as err:
        raise HFConversionError(f"{tag_dir}: the saved settings' lora_target_modules: {err}") from None


def _adapters_of(module: dict[str, torch.Tensor], lora: LoraSettings | None, family: str, arch: Architecture,
                 tag_dir: Path) -> dict[str, torch.Tensor]:
    """The adapters of ``lora``, taken out of ``module`` and keyed by their PEFT names; none without LoRA."""
    if lora is None:
        return {}
    names = peft_names(lora, family, arch.num_layers, expert_layers(arch))
    missing = [ours for ours in names if ours not in module]
    if missing:
        raise HFConversionError(f"{tag_dir}: {missing[0]} is missing ({len(missing)} adapter weights missing for the "
                                f"saved LoRA settings, lora_target_modules {', '.join(lora.target_modules)}); "
                                "the tag is incomplete: export another tag")
    return {peft: peft_layout(ours, module.pop(ours), arch.moe_num_experts) for ours, peft in names.items()}


def _merge_expert_adapters(module: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor], lora: LoraSettings,
                           family: str, arch: Architecture) -> None:
    """Each expert weight of ``module`` (our names) plus its experts' scaled B A, in fp32; the expert parameters'
    adapters taken out of ``adapters`` (PEFT keys and layout)."""
    names = peft_names(lora, family, arch.num_layers, expert_layers(arch))
    for layer in expert_layers(arch):
        prefix = f"sequential.{layer_key(layer)}.mlp.experts.mlp."
        deltas = {}
        for parameter in ("gate_up_proj", "down_proj"):
            a, b = (f"{prefix}lora.{parameter}.lora_{side}" for side in SIDES)
            if a in names:
                a, b = adapters.pop(names[a]).float(), our_layout(b, adapters.pop(names[b]).float(), arch.moe_num_experts)
                deltas[parameter] = ExpertAdapter.product(a, b, arch.moe_num_experts) * lora.scaling
        weights = tuple(module[f"{prefix}{w}"].float() for w in ("w1", "w3", "w2"))
        for name, merged in zip(("w1", "w3", "w2"), with_expert_deltas(weights, deltas, arch.moe_intermediate_size),
                                strict=True):
            module[f"{prefix}{name}"] = merged


def _peft_base(tag: TagInventory, lora: LoraSettings | None, arch: Architecture, base_model: Path | None) -> str:
    """PEFT's base_model_name_or_path for the adapters of ``tag``: ``base_model`` (checked to be this model), else
    the Hugging Face folder the run recorded as its base."""
    if lora is None:
        raise HFConversionError(f"{tag.path} holds no LoRA adapters (its run had lora_rank 0); --peft writes "
                                "adapters only: leave it out to export the model")
    if arch.reward_head:
        raise HFConversionError(f"{tag.path} is a reward model, whose new head rm_linear trained whole beside the "
                                "adapters; leave --peft out to export it merged")
    if base_model is not None:
        if not is_hf_model_dir(base_model):
            raise HFConversionError(f"--base-model {base_model} is no Hugging Face model folder (config.json and "
                                    "weights); name the folder of the model the adapters were trained on")
        check_hf_settings(base_model, arch)
        return str(Path(base_model).resolve())
    recorded = tag.saved_layout.lora_base
    if recorded is None or recorded.hf_folder is None:
        where = "records no base" if recorded is None else f"records its base {recorded.path}"
        raise HFConversionError(f"{tag.path} {where} as a Hugging Face folder; pass --base-model PATH, the Hugging "
                                "Face folder of the base model the adapters were trained on")
    return recorded.hf_folder


def _export_inputs(ckpt_dir: Path, tag: TagInventory, settings: dict[str, Any], config_files: list[Path] | None,
                   base_model: Path | None) -> list[str | Path | None]:
    """Every file or folder an export reads, which its output may not be, hold or lie in: the checkpoint, its
    config files and tokenizer, and an adapter-only tag's base (read for the merge, named by --peft)."""
    recorded = tag.saved_layout.lora_base
    return [ckpt_dir, *(config_files or ()), settings.get("vocab_file"), base_model,
            recorded and recorded.path, recorded and recorded.hf_folder]


def _write_peft_export(out_dir: Path, tag: TagInventory, lora: LoraSettings | None, arch: Architecture,
                       base_model: Path | None, adapters: dict[str, torch.Tensor]) -> Path:
    """The adapters as a PEFT folder, with the record of the base they were trained over beside them."""
    base_folder = _peft_base(tag, lora, arch, base_model)
    record = _peft_base_record(tag, base_folder)
    with staged_output(out_dir) as staging:
        write_peft_dir(staging, adapter_config(lora, base_folder), adapters)
        write_lora_base_file(staging, record)
    return out_dir


def _peft_base_record(tag: TagInventory, base_folder: str) -> LoraBase:
    """The record of the base a PEFT export's adapters were trained over, written beside them (identity.py): what
    the run recorded where its base was this very folder (the export then needs only the adapters, and a load of
    the export finds out whether the folder changed since); otherwise (a base named by --base-model, or a tag
    converted from it) the folder's files as they are now."""
    recorded = tag.saved_layout.lora_base
    if recorded is not None and recorded.tag is None and Path(recorded.source).resolve() == Path(base_folder).resolve():
        return LoraBase(recorded.source, None, recorded.checksum, base_folder)
    folder = Path(base_folder)
    return LoraBase(base_folder, None, files_checksum(HF_FOLDER.files(folder), folder, None), base_folder)


def _base_weights(tag: TagInventory, settings: dict[str, Any], arch: Architecture) -> dict[str, torch.Tensor]:
    """The frozen base under the adapters of an adapter-only ``tag``, read from the base it recorded through the
    load's own checked plan: a base that is gone or changed is refused in one line."""
    plan = lora_base_plan(LoadSettings.from_args(NeoXArgs.from_saved(settings, str(tag.path))), tag, 1, HF_FOLDER)
    if plan.hf_source is not None:
        weights = plan.hf_source.read_weights(plan.load_dir, arch)
    else:
        weights = read_full_module_weights(plan.tag_dir, plan.tag_inventory.saved_layout.tensor_parallel, arch)
    if arch.reward_head:  # a reward model over a language model: its head trained whole, in the tag
        weights = {name: value for name, value in weights.items() if not name.endswith("final_linear.weight")}
    return weights
