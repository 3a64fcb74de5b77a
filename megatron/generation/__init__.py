"""Text generation from a trained model (generate.py): GPT-NeoX's settings, output and meaning."""

from megatron.generation.completion import Completion, Limits, complete
from megatron.generation.errors import GenerationError
from megatron.generation.samples import check_generation_settings, generate_samples
from megatron.generation.sampling import Sampling, next_tokens

__all__ = ["Completion", "GenerationError", "Limits", "Sampling", "check_generation_settings", "complete",
           "generate_samples", "next_tokens"]
