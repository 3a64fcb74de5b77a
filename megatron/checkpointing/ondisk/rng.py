"""The random-number-generator states of one rank, as plain values a checkpoint can hold.

numpy's state array is stored as a list of ints so the saved state loads with
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from megatron.checkpointing.errors import CheckpointError


def _accelerator():
    try:
        from deepspeed.accelerator import get_accelerator
    except ImportError:
        return None
    return get_accelerator()


def collect_rng_states() -> dict[str, Any]:
    """Python, numpy, torch CPU and accelerator generator states of this rank."""
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    states: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": keys.tolist(), "pos": int(pos), "has_gauss": int(has_gauss),
                  "cached_gaussian": float(cached_gaussian)},
        "torch_cpu": torch.get_rng_state(),
    }
    accelerator = _accelerator()
    if accelerator is not None and accelerator.device_name() != "cpu":
        states["accelerator"] = accelerator.get_rng_state()
    return states


def restore_rng_states(states: dict[str, Any]) -> None:
    """Set every generator collect_rng_states() recorded; a missing part is an error, not a skip."""
    missing = [name for name in ("python", "numpy", "torch_cpu") if name not in states]
    if missing:
        raise CheckpointError(
            f"the checkpoint's RNG states lack {', '.join(missing)}; set `no_load_rng: true` to start "
            "with fresh generators."
        )
    random.setstate(_as_python_state(states["python"]))
    numpy_state = states["numpy"]
    np.random.set_state((numpy_state["kind"], np.asarray(numpy_state["keys"], dtype=np.uint32),
                         numpy_state["pos"], numpy_state["has_gauss"], numpy_state["cached_gaussian"]))
    torch.set_rng_state(states["torch_cpu"])
    accelerator = _accelerator()
    if accelerator is not None and accelerator.device_name() != "cpu":
        if "accelerator" not in states:
            raise CheckpointError(
                f"the checkpoint holds no {accelerator.device_name()} RNG state (it was saved on CPU); "
                "set `no_load_rng: true` to start with fresh generators."
            )
        accelerator.set_rng_state(states["accelerator"])


def _as_python_state(state: Any) -> tuple:
    """random.setstate needs tuples; a round trip through some serialisers turns them into lists."""
    version, internal, gauss = state
    return (version, tuple(internal), gauss)
