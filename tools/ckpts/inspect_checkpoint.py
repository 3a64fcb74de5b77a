"""Describe a checkpoint folder: tags, format, iteration, parameters, saved settings, optimizer states, load modes.

    python tools/ckpts/inspect_checkpoint.py CKPT_DIR [--tag TAG] [--json] [--diff OTHER_DIR [--other-tag TAG]]

CKPT_DIR is a checkpoint of ours (DeepSpeed model-states, ZeRO shards or GPT-NeoX pipeline layer
files) or a Hugging Face model folder. Which load modes work is decided by the trainer's own load
plan (megatron.checkpointing.planning.plan), asked once per mode with the checkpoint's own ZeRO stage,
precision and data-parallel size, and asked for a full resume at each shape of a small grid (data- and
tensor-parallel size, ZeRO stage, precision; a resume at another shape reshards the optimizer state).
--diff compares the weights (under our names) with another
checkpoint: keys on one side only, shape changes, and the largest absolute difference per tensor.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron.foreign_notices import hide_foreign_notices  # noqa: E402

hide_foreign_notices()  # before the imports below

# DeepSpeed's logger writes to the stdout it finds at import; bind it to stderr so --json output stays parseable.
with contextlib.redirect_stdout(sys.stderr):
    import torch

    from megatron.checkpointing import (
        LATEST_FILE,
        CheckpointError,
        CheckpointInventory,
        LoadMode,
        TagInventory,
        build_load_plan,
        inventory_checkpoint,
        read_full_module_weights,
        read_module_weights,
    )
    from megatron.contract.architecture import ModelConfigError, describe_model
    from megatron.hf.config import architecture_of
    from megatron.hf.folder_weights import HF_FOLDER, read_hf_model
    from megatron.neox_arguments import ConfigError, NeoXArgs
    from megatron.optim.optimizer_layout import PRECISIONS

MODE_FLAGS = {
    LoadMode.RESUME: {},
    LoadMode.NO_LOAD_OPTIM: {"no_load_optim": True},
    LoadMode.FINETUNE: {"finetune": True},
}


def chosen_tag(inventory: CheckpointInventory, tag: str | None) -> TagInventory | None:
    return None if inventory.is_hf else inventory.chosen_tag(tag=tag, pick_with="--tag {tag}")


def module_weights(inventory: CheckpointInventory, tag: TagInventory | None) -> dict[str, torch.Tensor]:
    """The weights under our names: a tag's module, or an HF folder converted on the fly."""
    if tag is None:
        return read_hf_model(inventory.root)[1]
    return tag_weights(tag)


def tag_weights(tag: TagInventory) -> dict[str, torch.Tensor]:
    """The whole tensors of a tag, its tensor-parallel ranks' parts joined (by the saved architecture)."""
    settings = tag.metadata.saved_args if tag.metadata else None
    if tag.saved_layout.tensor_parallel == 1 or not settings:
        return read_module_weights(tag.path)
    return read_full_module_weights(tag.path, tag.saved_layout.tensor_parallel, architecture_of({**settings, "model_parallel_size": 1}))


def saved_model(settings: dict[str, Any] | None) -> str | None:
    """The family and variants of the model the saved settings describe; None where they describe none."""
    if not settings:
        return None
    try:
        return describe_model(architecture_of({**settings, "model_parallel_size": 1}), settings.get("hf_model_type"))
    except (ConfigError, ModelConfigError):
        return None


def parameter_summary(weights: dict[str, torch.Tensor]) -> dict[str, Any]:
    dtypes = Counter()
    for tensor in weights.values():
        dtypes[str(tensor.dtype).removeprefix("torch.")] += tensor.numel()
    return {"tensors": len(weights), "parameters": sum(dtypes.values()), "elements_by_dtype": dict(dtypes)}


def load_modes(
    inventory: CheckpointInventory, tag: TagInventory | None, settings: dict[str, Any]
) -> dict[str, dict[str, Any]]:
    """For each load mode: whether the trainer's load plan accepts this checkpoint, and its plan or its refusal.

    The plan is asked on behalf of a run with the checkpoint's own ``settings`` (architecture included).
    """
    metadata = tag.metadata if tag is not None else None
    values: dict[str, Any] = {**settings, "load": str(inventory.root), "finetune": False, "no_load_optim": False,
                              "iteration": None}
    if tag is not None and tag.iteration is not None and tag.tag != inventory.latest:
        values["iteration"] = tag.iteration
    if metadata is not None:
        values.update(zero_optimization={"stage": metadata.zero_stage}, precision=metadata.precision)
    dp_size = tag.saved_layout.data_parallel if tag is not None else 1
    result = {}
    for mode, flags in MODE_FLAGS.items():
        try:
            plan = build_load_plan(NeoXArgs.from_saved({**values, **flags}, str(inventory.root), require_model=False),
                                   inventory, dp_size, HF_FOLDER)
        except (CheckpointError, ConfigError) as refusal:
            result[mode.value] = {"possible": False, "reason": str(refusal)}
        else:
            result[mode.value] = {"possible": True, "plan": plan.describe()}
    return result


# The shapes a full resume is asked about, around the saved one: data- and tensor-parallel sizes (at the
# saved ZeRO stage and precision), and ZeRO stages and precisions (at the saved sizes).
DATA_PARALLEL_SIZES = (1, 2, 4)
ZERO_STAGES = (0, 1, 2, 3)


def full_resume_shapes(inventory: CheckpointInventory, tag: TagInventory | None,
                       settings: dict[str, Any]) -> dict[str, list[str]]:
    """Where the trainer's load plan accepts a full resume with the same global batch (a resume at another
    shape reshards the optimizer state): the parallel sizes, and the ZeRO stages and precisions."""
    if tag is None or tag.metadata is None:
        return {"parallel_sizes": [], "zero_stages_and_precisions": []}
    base = {key: value for key, value in settings.items() if key not in ("gradient_accumulation_steps", "num_gpus")}
    base.update(load=str(inventory.root), save=str(inventory.root), finetune=False, no_load_optim=False,
                iteration=tag.iteration if tag.tag != inventory.latest else None)
    saved_dp, saved_tp = tag.saved_layout.data_parallel, tag.saved_layout.tensor_parallel

    def accepted(dp: int, tp: int, stage: int, precision: str) -> bool:
        values = {**base, "model_parallel_size": tp, "num_gpus": tp * dp, "precision": precision,
                  "zero_optimization": {"stage": stage}, "fp16": {"enabled": precision == "fp16"},
                  "bf16": {"enabled": precision == "bf16"}}
        try:
            build_load_plan(NeoXArgs.from_saved(values, str(inventory.root), require_model=False), inventory, dp,
                            HF_FOLDER)
        except (CheckpointError, ConfigError):
            return False
        return True

    stage, precision = tag.metadata.zero_stage, tag.metadata.precision
    return {
        "parallel_sizes": [f"DP {dp} x TP {tp}" for tp in sorted({1, 2, saved_tp, 2 * saved_tp})
                           for dp in DATA_PARALLEL_SIZES if accepted(dp, tp, stage, precision)],
        "zero_stages_and_precisions": [f"ZeRO-{z} {p}" for z in ZERO_STAGES for p in PRECISIONS
                                       if accepted(saved_dp, saved_tp, z, p)],
    }


def describe(root: Path, tag_name: str | None) -> dict[str, Any]:
    inventory = inventory_checkpoint(root, HF_FOLDER)
    if not inventory.exists:
        raise CheckpointError(f"{root} does not exist")
    report: dict[str, Any] = {
        "path": str(inventory.root),
        "format": inventory.format,
        "latest": inventory.latest,
        "tags": {name: {"iteration": t.iteration, "format": t.format} for name, t in inventory.tags.items()},
    }
    tag = chosen_tag(inventory, tag_name)
    if tag is None:
        spec, weights = read_hf_model(inventory.root)
        report.update(hf_family=spec.family, saved_settings={**spec.settings, "padded_vocab_size": spec.vocab_size},
                      model=describe_model(spec.architecture(), spec.family))
    else:
        metadata = tag.metadata
        weights = tag_weights(tag)
        saved_iteration = metadata.client_state.iteration if metadata else None
        report.update(
            tag=tag.tag,
            tag_format=tag.format,
            iteration=saved_iteration if saved_iteration is not None else tag.iteration,
            zero_stage=metadata.zero_stage if metadata else None,
            precision=metadata.precision if metadata else None,
            dp_world_size=tag.saved_layout.data_parallel,
            tensor_parallel_size=tag.saved_layout.tensor_parallel,
            pipeline_stages=tag.saved_pp_size,
            lora_base=tag.saved_layout.lora_base.to_dict() if tag.saved_layout.adapters_only else None,
            optimizer_states={
                "in_model_states_file": bool(metadata and metadata.has_optimizer_in_file),
                "zero_shard_dp_ranks": list(tag.optimizer_dp_ranks),
                "universal": tag.universal,
            },
            saved_settings=metadata.saved_args if metadata else None,
            model=saved_model(metadata.saved_args if metadata else None),
        )
    report["parameters"] = parameter_summary(weights)
    report["load_modes"] = load_modes(inventory, tag, report["saved_settings"] or {})
    report["full_resume_at"] = full_resume_shapes(inventory, tag, report["saved_settings"] or {})
    return report


def diff(root: Path, tag_name: str | None, other_root: Path, other_tag: str | None) -> dict[str, Any]:
    sides = []
    for path, name in ((root, tag_name), (other_root, other_tag)):
        inventory = inventory_checkpoint(path, HF_FOLDER)
        sides.append(module_weights(inventory, chosen_tag(inventory, name)))
    mine, theirs = sides
    common = sorted(set(mine) & set(theirs))
    shapes = {k: [list(mine[k].shape), list(theirs[k].shape)] for k in common if mine[k].shape != theirs[k].shape}
    max_abs = {
        k: (mine[k].float() - theirs[k].float()).abs().max().item() if mine[k].numel() else 0.0
        for k in common
        if k not in shapes
    }
    return {
        "only_in_first": sorted(set(mine) - set(theirs)),
        "only_in_second": sorted(set(theirs) - set(mine)),
        "shape_differs": shapes,
        "dtype_differs": {k: [str(mine[k].dtype), str(theirs[k].dtype)] for k in max_abs if mine[k].dtype != theirs[k].dtype},
        "max_abs_difference": {k: v for k, v in max_abs.items() if v != 0.0},
        "identical_tensors": sum(1 for v in max_abs.values() if v == 0.0),
    }


def print_report(report: dict[str, Any]) -> None:
    print(f"checkpoint {report['path']}  format {report['format']}  latest {report['latest']}")
    for name, tag in report["tags"].items():
        print(f"  tag {name}: iteration {tag['iteration']}, {tag['format']}")
    if "tag" in report:
        print(f"tag {report['tag']} ({report['tag_format']}): iteration {report['iteration']}, "
              f"ZeRO stage {report['zero_stage']}, precision {report['precision']}, "
              f"saved by {report['dp_world_size']} data-parallel rank(s) x {report['tensor_parallel_size']} "
              f"tensor-parallel x {report['pipeline_stages']} pipeline stage(s)")
        if report["lora_base"]:
            base = report["lora_base"]
            print(f"  LoRA adapters only (the parameters that train), over the base {base['source']}"
                  f"{' tag ' + base['tag'] if base['tag'] else ''} (checksum {base['checksum']}): loads read it there")
        optim = report["optimizer_states"]
        print(f"  optimizer states: in model-states file {optim['in_model_states_file']}, "
              f"ZeRO shards for DP ranks {optim['zero_shard_dp_ranks'] or 'none'}, universal {optim['universal']}")
    else:
        print(f"Hugging Face {report['hf_family']} model")
    print(f"  model: {report['model'] or 'not described by the saved settings'}")
    params = report["parameters"]
    dtypes = ", ".join(f"{n:,} {d}" for d, n in params["elements_by_dtype"].items())
    print(f"  parameters: {params['parameters']:,} in {params['tensors']} tensors ({dtypes})")
    settings = report.get("saved_settings") or {}
    shown = {k: v for k, v in settings.items() if v is not None and k != "config_files"}
    print("  saved settings: " + (", ".join(f"{k}={v}" for k, v in shown.items()) or "none"))
    for mode, verdict in report["load_modes"].items():
        text = verdict["plan"].splitlines()[0] if verdict["possible"] else verdict["reason"]
        print(f"  {mode}: {'possible' if verdict['possible'] else 'not possible'}: {text}")
    if "tag" in report:
        shapes = report["full_resume_at"]
        print(f"  full resume (same global batch) at {', '.join(shapes['parallel_sizes']) or 'no parallel size'} "
              f"(ZeRO stage and precision as saved); with {', '.join(shapes['zero_stages_and_precisions']) or 'none'} "
              "(parallel sizes as saved)")


def print_diff(result: dict[str, Any]) -> None:
    for key in ("only_in_first", "only_in_second"):
        for name in result[key]:
            print(f"{key.replace('_', ' ')}: {name}")
    for name, (a, b) in result["shape_differs"].items():
        print(f"shape differs: {name} {a} vs {b}")
    for name, (a, b) in result["dtype_differs"].items():
        print(f"dtype differs: {name} {a} vs {b}")
    for name, value in result["max_abs_difference"].items():
        print(f"values differ: {name} max |a - b| = {value:.3e}")
    print(f"{result['identical_tensors']} tensors identical")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="checkpoint folder (holds `latest` and tags) or HF model folder")
    parser.add_argument("--tag", help=f"tag to describe (default: the one in `{LATEST_FILE}`)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.add_argument("--diff", type=Path, metavar="OTHER_DIR", help="compare the weights with another checkpoint")
    parser.add_argument("--other-tag", help="tag of OTHER_DIR (default: its latest)")
    options = parser.parse_args(argv)
    try:
        if options.diff is not None:
            result = diff(options.checkpoint, options.tag, options.diff, options.other_tag)
            show = print_diff
        else:
            result = describe(options.checkpoint, options.tag)
            show = print_report
    except CheckpointError as err:  # HFConversionError is one too
        print(f"error: {err}", file=sys.stderr)
        return 1
    if options.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        show(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
