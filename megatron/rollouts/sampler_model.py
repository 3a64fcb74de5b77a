"""The model the rollouts sample from: the policy being trained, with its current weights.

Under ZeRO-3 the policy's parameters are partitioned over the data-parallel ranks, and its forward gathers each
layer's in a collective that every rank must join; completions of different lengths would have the ranks run
different numbers of forwards. So there the sampler runs a whole copy (this tensor-parallel rank's shard, in the
policy's precision), refreshed from the gathered partitions before each micro batch's sampling: no collective
runs inside generation. The copy stays in memory between micro batches (one model more, as a generation engine
holds), and is built once, from `build` (the model without partitioning)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron.model.zero3_partition import is_partitioned


class SamplerModel:
    def __init__(self, policy: torch.nn.Module, build: Callable[[], torch.nn.Module]):
        self.policy = policy
        self.build = build
        self.partitioned = any(map(is_partitioned, policy.parameters()))
        self.copy: torch.nn.Module | None = None

    def current(self) -> torch.nn.Module:
        """The model holding the policy's weights as they are now (the policy itself unless it is partitioned)."""
        if not self.partitioned:
            return self.policy
        import deepspeed

        if self.copy is None:
            dtype = next(self.policy.parameters()).dtype
            self.copy = self.build().to(dtype=dtype).requires_grad_(False).eval()
        targets = dict(self.copy.named_parameters())
        with torch.no_grad():
            for name, param in self.policy.named_parameters():
                with deepspeed.zero.GatheredParameters([param]):
                    targets[name].copy_(param.data)
        return self.copy
