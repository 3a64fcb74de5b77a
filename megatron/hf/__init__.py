"""Hugging Face interop: GPTNeoXForCausalLM and LlamaForCausalLM <-> our parameter names and settings."""

from megatron.hf.errors import HFConversionError
from megatron.hf.io import is_hf_model_dir
from megatron.hf.load import HF_FOLDER, check_hf_settings, load_hf_module_weights

__all__ = ["HF_FOLDER", "HFConversionError", "check_hf_settings", "is_hf_model_dir", "load_hf_module_weights"]
