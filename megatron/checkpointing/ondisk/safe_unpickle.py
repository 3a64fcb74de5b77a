"""The one way a file this program is handed gets unpickled: torch's weights-only unpickler.

That unpickler builds tensors, containers and plain values, and otherwise only the classes named in
trusted_globals(); anything else (a function to call, a class whose ``__reduce__`` runs code) is
refused, so reading a checkpoint never runs code from it. A refused file is an error naming the
file and what it holds, never a retry with the full unpickler.

trusted_globals() is exactly what legitimate checkpoints carry besides tensors, found by saving real
ones (fp32, bf16, fp16; ZeRO 0-3; CPU offload) and reading them weights-only:

* DeepSpeed's optimizer files: the loss scaler (``LossScaler``; ``DynamicLossScaler`` under fp16),
  the ZeRO stage as ``ZeroStageEnum``, and ZeRO 1-2's ``fragment_address`` (numel, start) records.
* GPT-NeoX's model-states files: ``np_rng_state`` is numpy's generator state, a uint32 array
  (numpy 1 pickles its rebuild function under ``numpy.core``, numpy 2 under ``numpy._core``).
* Older Megatron runs pickled their settings as an ``argparse.Namespace``.

Each of these only stores the values it is built from; none imports or calls anything else.

plain_values() is the stricter decoder for pickles from elsewhere (GPT-NeoX's REINFORCE data server replies
with one): lists, dicts, numbers, strings and None only, no class at all, so nothing in the bytes can run.
"""

from __future__ import annotations

import argparse
import io
import os
import pickle
import re
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megatron.checkpointing.errors import CheckpointError


@cache
def trusted_globals() -> list:
    """The classes besides tensors that the unpickler may build (see above); DeepSpeed is imported once a file is read."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    numpy_reconstruct = np.ndarray.__reduce__(np.zeros(0))[0]  # numpy's array rebuild function
    return [
        LossScaler,
        DynamicLossScaler,
        ZeroStageEnum,
        fragment_address,
        np.ndarray,
        np.dtype,
        (numpy_reconstruct, "numpy.core.multiarray._reconstruct"),
        (numpy_reconstruct, "numpy._core.multiarray._reconstruct"),
        argparse.Namespace,
    ]


# torch's messages name the refused global in one of these two forms
_REFUSED_GLOBAL = re.compile(r"GLOBAL (\S+) (?:was not an allowed global|whose module)")


def load_weights_only(path: str | Path, map_location: Any = "cpu", mmap: bool = True,
                      shown_as: str | Path | None = None) -> Any:
    """torch.load `path` weights-only with trusted_globals(); a refused or unreadable file is a CheckpointError
    naming `shown_as` (default `path`).

    With ``mmap`` the tensors are mapped from the file, read only where they are used.
    """
    shown_as = path if shown_as is None else shown_as
    with torch.serialization.safe_globals(trusted_globals()):
        try:
            return torch.load(path, map_location=map_location, mmap=mmap, weights_only=True)
        except pickle.UnpicklingError as err:
            raise refused_file_error(f"checkpoint file {shown_as}", err) from None
        except Exception as err:  # torch raises several types for a damaged pickle / zip archive
            raise CheckpointError(
                f"cannot read checkpoint file {shown_as}: {type(err).__name__}: {_first_line(err)}. The file is "
                "truncated or corrupt (an interrupted save?); load another checkpoint tag or re-create this one."
            ) from None


def refused_file_error(which: str, err: pickle.UnpicklingError) -> CheckpointError:
    """The one-line error for a file the weights-only unpickler refused; `which` names the file."""
    return CheckpointError(
        f"{which} holds {_refused_what(err)}, which loading it would have to run; it is not a file "
        "this trainer wrote or can trust, so it was not loaded. Re-create the checkpoint, or convert the weights "
        "from a source you trust (e.g. tools/ckpts/convert_hf_to_neox.py from safetensors)."
    )


@contextmanager
def every_torch_load_weights_only(source: str | Path) -> Iterator[None]:
    """Within the block, every torch.load is weights-only with trusted_globals(), whatever its caller asked.

    For code that calls torch.load itself (DeepSpeed's universal-checkpoint readers pass
    ``weights_only=False``): torch's ``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` overrides the argument.
    A refused file there is reported against `source`, the checkpoint being read.
    """
    name = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"
    before = os.environ.get(name)
    os.environ[name] = "1"
    try:
        with torch.serialization.safe_globals(trusted_globals()):
            yield
    except pickle.UnpicklingError as err:
        raise refused_file_error(f"a checkpoint file in {source}", err) from None
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def _refused_what(err: pickle.UnpicklingError) -> str:
    match = _REFUSED_GLOBAL.search(str(err))
    if match:
        return f"a reference to {match.group(1)}"
    return f"a pickled object the weights-only unpickler refuses ({_first_line(err)})"


def _first_line(err: Exception) -> str:
    return next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)


_PLAIN_TYPES = (list, dict, int, float, str, type(None))


class _NoClassesUnpickler(pickle.Unpickler):
    """Builds containers and plain values; every class or function the stream names is refused unbuilt."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"a reference to {module}.{name}")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("a persistent object reference")


def plain_values(data: bytes) -> Any:
    """The lists, dicts, numbers and strings `data` pickles; pickle.UnpicklingError naming the first other thing
    (a class or function reference is refused before anything is built from it, so nothing of it runs)."""
    value = _NoClassesUnpickler(io.BytesIO(data)).load()
    pending = [value]
    while pending:
        item = pending.pop()
        if not isinstance(item, _PLAIN_TYPES):
            raise pickle.UnpicklingError(f"a {type(item).__name__}")
        if isinstance(item, list):
            pending.extend(item)
        elif isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
    return value
