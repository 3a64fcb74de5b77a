"""The transformer: GPT-NeoX/Pythia and Llama families as options of one decoder-only model."""

from megatron.contract.architecture import ModelConfigError
from megatron.model.gpt_model import GPTModel, build_model
from megatron.model.kv_cache import KVCache
from megatron.model.loss import causal_lm_loss, token_log_probs
from megatron.model.moe import expert_load, load_balancing_loss
from megatron.model.param_groups import no_weight_decay_param_names

__all__ = [
    "GPTModel",
    "KVCache",
    "ModelConfigError",
    "build_model",
    "causal_lm_loss",
    "expert_load",
    "load_balancing_loss",
    "no_weight_decay_param_names",
    "token_log_probs",
]
