"""Hugging Face interop: GPTNeoXForCausalLM and LlamaForCausalLM <-> our parameter names and settings."""

from megatron.hf.errors import HFConversionError
from megatron.hf.folder_weights import HF_FOLDER, check_hf_settings, load_hf_module_weights
from megatron.hf.io import is_hf_model_dir

__all__ = ["HF_FOLDER", "HFConversionError", "check_hf_settings", "is_hf_model_dir", "load_hf_module_weights"]
