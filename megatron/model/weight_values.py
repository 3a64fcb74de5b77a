"""Whether a stored tensor can be a weight the model trains from, checked once as a checkpoint or a Hugging
Face folder is read (every caller raises its own area's error with the file it read)."""

from __future__ import annotations

import torch

# What the model computes in (fp32, bf16, fp16) and what loads into it exactly (fp64): a quantised or integer
# tensor is codes and scales, not values, and copying it into the model would train from nonsense
TRAINABLE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def untrainable_weight(name: str, tensor: torch.Tensor) -> str | None:
    """What makes `tensor` unusable as weight `name`: a dtype the model does not train in, or NaN/infinity;
    None when it is usable."""
    if tensor.dtype not in TRAINABLE_DTYPES:
        allowed = ", ".join(str(dtype).removeprefix("torch.") for dtype in TRAINABLE_DTYPES)
        return (f"tensor {name!r} is {str(tensor.dtype).removeprefix('torch.')}, not a floating-point type the model "
                f"trains from ({allowed}); dequantise or convert the weights to one of them first")
    not_finite = int((~torch.isfinite(tensor)).sum())
    if not_finite:
        return (f"tensor {name!r} holds {not_finite} NaN or infinite values of {tensor.numel()}; these weights "
                "cannot be trained from: use a checkpoint saved before the values went bad")
    return None
