"""Opt-in views into a run, as GPT-NeoX offers them: per-parameter norms, a torch.profiler trace,
a CUDA memory snapshot. None of them changes what is computed."""

from __future__ import annotations

import os
import pickle

import torch

MEMORY_SNAPSHOT_NAME = "mem_snapshot.pickle"


def _full_gradient(param: torch.nn.Parameter) -> torch.Tensor | None:
    from deepspeed.utils import safe_get_full_grad

    return safe_get_full_grad(param)


def _full_parameter(param: torch.nn.Parameter) -> torch.Tensor:
    from deepspeed.utils import safe_get_full_fp32_param

    full = safe_get_full_fp32_param(param)  # ZeRO partitions and fp32 master copies, gathered
    return param.detach() if full is None else full


def parameter_norms(engine, *, gradients: bool, parameters: bool) -> dict[str, float]:
    """`gradient_norms/<name>` and `parameter_norms/<name>` (GPT-NeoX's names) of every parameter.

    Gradients are read after the last backward of a step and before the optimizer step. Under
    ZeRO every rank must call this: gathering a partitioned tensor is a collective.
    """
    norms: dict[str, float] = {}
    for name, param in engine.module.named_parameters():
        if gradients:
            grad = _full_gradient(param)
            if grad is not None:
                norms[f"gradient_norms/{name}"] = grad.float().norm().item()
        if parameters:
            norms[f"parameter_norms/{name}"] = _full_parameter(param).float().norm().item()
    return norms


class StepProfiler:
    """`profile`: a torch.profiler trace of steps profile_step_start..profile_step_stop, written for
    TensorBoard into tensorboard_dir. `memory_profiling`: CUDA allocation history, saved as
    memory_profiling_path/mem_snapshot.pickle after each of those steps (rank 0)."""

    def __init__(self, args, rank: int):
        self.start, self.stop = args.profile_step_start, args.profile_step_stop
        self.snapshot_dir = args.memory_profiling_path if args.memory_profiling and rank == 0 else None
        self.profiler = None
        if args.memory_profiling and torch.cuda.is_available():
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        if args.profile:
            self.profiler = torch.profiler.profile(
                schedule=torch.profiler.schedule(wait=self.start, warmup=1, active=self.stop - self.start),
                on_trace_ready=torch.profiler.tensorboard_trace_handler(args.tensorboard_dir),
                record_shapes=True, profile_memory=True, with_flops=True, with_modules=True, with_stack=True,
            )
            self.profiler.start()

    def before_step(self, iteration: int) -> None:
        """Before the step that starts at `iteration` (0 for the first step of a fresh run)."""
        if self.profiler is not None:
            self.profiler.step()

    def after_step(self, iteration: int) -> None:
        """After the step that started at `iteration`."""
        if self.profiler is not None and iteration == self.stop:
            self.profiler.stop()
            self.profiler = None
        if self.snapshot_dir is not None and self.start <= iteration <= self.stop:
            save_memory_snapshot(self.snapshot_dir)

    def close(self) -> None:
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler = None


def save_memory_snapshot(directory: str) -> None:
    """CUDA's allocation history as GPT-NeoX saves it; an empty snapshot on a machine without CUDA."""
    snapshot = torch.cuda.memory._snapshot() if torch.cuda.is_available() else {"segments": [], "device_traces": []}
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, MEMORY_SNAPSHOT_NAME), "wb") as stream:
        pickle.dump(snapshot, stream)
