"""megatron-core's tensor-parallel layers, configured once for this model.

The subclasses leave megatron-core's always-empty ``_extra_state`` entries out of the state dicts
they save, so a state dict holds exactly GPT-NeoX's parameter names; loading still accepts a state
dict with or without them (megatron-core fills in and ignores the entry).
"""

from __future__ import annotations

import torch

from megatron.core import parallel_state, tensor_parallel
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.model.errors import ModelConfigError


def model_parallel_config() -> ModelParallelConfig:
    if not parallel_state.model_parallel_is_initialized():
        raise ModelConfigError(
            "megatron-core's process groups are not initialised; call "
            "megatron.core.parallel_state.initialize_model_parallel after torch.distributed before building the model"
        )
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    if tp_size != 1:
        raise ModelConfigError(
            f"tensor-parallel size {tp_size}: only tensor-parallel size 1 is supported for now"
        )
    return ModelParallelConfig(
        tensor_model_parallel_size=tp_size, use_cpu_initialization=True, params_dtype=torch.float32
    )


def tensor_parallel_size() -> int:
    return parallel_state.get_tensor_model_parallel_world_size()


class _WithoutExtraState:
    get_extra_state = torch.nn.Module.get_extra_state


class ColumnParallelLinear(_WithoutExtraState, tensor_parallel.ColumnParallelLinear):
    pass


class RowParallelLinear(_WithoutExtraState, tensor_parallel.RowParallelLinear):
    pass


class VocabParallelEmbedding(_WithoutExtraState, tensor_parallel.VocabParallelEmbedding):
    pass
