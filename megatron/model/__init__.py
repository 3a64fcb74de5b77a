"""The transformer: GPT-NeoX/Pythia and Llama families as options of one decoder-only model."""

from megatron.model.architecture import Architecture, architecture_from_args, derive_size_defaults
from megatron.model.errors import ModelConfigError
from megatron.model.gpt_model import GPTModel, build_model
from megatron.model.loss import causal_lm_loss
from megatron.model.param_groups import no_weight_decay_param_names

__all__ = [
    "Architecture",
    "GPTModel",
    "ModelConfigError",
    "architecture_from_args",
    "build_model",
    "causal_lm_loss",
    "derive_size_defaults",
    "no_weight_decay_param_names",
]
