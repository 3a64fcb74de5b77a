"""LoadSettings: the run's settings a load plan reads, taken from the whole settings once (`from_args`) at the top
of a load and handed down to the plan, its checks (preflight.py), the shape change (shape.py) and the data
position (data_position.py).

A caller that wants the weights only of a model (generate.py and eval.py, the precompute of a reference, a
DPO/KTO reference or a LoRA base a save recorded) says so with `weights_only`, which loads them as a fine-tune
does; it never rewrites the run's settings to steer the plan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from megatron.checkpointing.planning.data_position import PositionSettings
from megatron.contract.architecture import Architecture, fields_of_settings
from megatron.contract.lora_settings import LoraSettings


@dataclass(frozen=True)
class LoadSettings:
    load: str | None
    save: str | None
    finetune: bool
    no_load_optim: bool
    no_load_rng: bool
    iteration: int | None
    load_module_strict: bool
    load_module_allow_random: tuple[str, ...]
    checkpoint_validation_with_forward_pass: bool
    train_impl: str
    lora_rank: int
    hf_model_type: str | None
    precision: str
    fp16: Any
    bf16: Any
    zero_stage: int | None
    zero_optimization: Mapping[str, Any] | None
    deepspeed_extra_args: Mapping[str, Any] | None
    model_parallel_size: int | None
    pipe_parallel_size: int | None
    moe_num_experts: int | None
    padded_vocab_size: int | None
    train_iters: int | None
    position: PositionSettings  # where the data continue (data_position.py)
    lora: LoraSettings | None  # the run's adapters (NeoXArgs.lora)
    architecture_fields: Mapping[str, Any]  # the compared fields of the run's model (preflight's strict check)
    # The run's model (NeoXArgs.architecture), resolved only where it is needed: a plan that is only inspected
    # needs no padded vocabulary.
    architecture: Callable[[], Architecture] = field(repr=False, compare=False)
    sources: Mapping[str, str] = field(repr=False)  # the config file that set each setting

    @classmethod
    def from_args(cls, args) -> LoadSettings:
        return cls(
            load=args.load, save=args.save, finetune=args.finetune, no_load_optim=args.no_load_optim,
            no_load_rng=args.no_load_rng, iteration=args.iteration, load_module_strict=args.load_module_strict,
            load_module_allow_random=tuple(args.load_module_allow_random or ()),
            checkpoint_validation_with_forward_pass=args.checkpoint_validation_with_forward_pass,
            train_impl=args.train_impl, lora_rank=args.lora_rank, hf_model_type=args.hf_model_type,
            precision=args.precision, fp16=args.fp16, bf16=args.bf16, zero_stage=args.zero_stage,
            zero_optimization=args.zero_optimization, deepspeed_extra_args=args.deepspeed_extra_args,
            model_parallel_size=args.model_parallel_size, pipe_parallel_size=args.pipe_parallel_size,
            moe_num_experts=args.moe_num_experts, padded_vocab_size=args.padded_vocab_size,
            train_iters=args.train_iters, position=PositionSettings.from_args(args), lora=args.lora(),
            architecture_fields=fields_of_settings(args.to_dict()), architecture=args.architecture,
            sources=args.sources)

    def source_of(self, name: str) -> str:
        """The config file that set `name`, or "default" / "derived" (NeoXArgs.source_of)."""
        return self.sources[name]

    def weights_only(self, stated_by: str, load: str | None = None, iteration: int | None = None) -> LoadSettings:
        """A load of the weights only, as a fine-tune loads them: of `load` (default: this run's) at `iteration`
        (default: this run's when `load` is this run's, else the tag in `latest`). `stated_by` names the caller
        as the source of these choices."""
        changes = {"finetune": True, "no_load_optim": False}
        if load is not None:
            changes.update(load=load, iteration=iteration)
        sources = {**self.sources, **dict.fromkeys(changes, stated_by)}
        return dataclasses.replace(self, **changes, sources=sources)
