"""Watching the experts' load: what share of each expert layer's token slots its router sends to each expert.

The language-model objective reports every expert's share per layer as ``expert_load/layer_<L>/expert_<E>``
(L the layer's number from 0, as moe_expert_interval counts; the shares of a layer sum to 1), averaged over
the step's micro batches and ranks like every metric, so TensorBoard gets them as
``train/expert_load/...``. The iteration line carries the largest of them, ``max_expert_load``.

A router that sends (almost) every token of a layer to one expert has collapsed: the layer's other
experts stop training. When one expert gets more than ``moe_collapse_token_share`` of a layer's tokens
(its slot share x moe_top_k: a token picks an expert at most once) for ``moe_collapse_steps`` steps in a row,
one line says which layer and expert, once per such stretch. A layer whose tokens all go to every expert
(moe_top_k = moe_num_experts) has nothing to collapse.
"""

from __future__ import annotations

import torch

from megatron.contract.architecture import Architecture


def expert_load_name(layer: int, expert: int) -> str:
    return f"expert_load/layer_{layer}/expert_{expert}"


def expert_layers(arch: Architecture) -> list[int]:
    return [layer for layer in range(arch.num_layers) if arch.has_experts(layer)]


def expert_load_metrics(arch: Architecture, loads: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every expert's share of its layer's routed token slots, from each expert layer's ``moe.expert_load``."""
    metrics = {}
    for layer, shares in zip(expert_layers(arch), loads, strict=True):
        metrics.update({expert_load_name(layer, expert): share for expert, share in enumerate(shares)})
    return metrics


class ExpertLoadWatch:
    """Reads the experts' load from each step's averaged metrics (train_impl normal reports it)."""

    def __init__(self, args):
        arch = args.architecture()
        self.layers = expert_layers(arch) if arch.moe and args.train_impl == "normal" else []
        self.num_experts, self.top_k = arch.moe_num_experts, arch.moe_top_k
        self.collapse_share, self.collapse_steps = args.moe_collapse_token_share, args.moe_collapse_steps
        self.streaks: dict[int, tuple[int, int]] = {}  # layer -> (expert, steps in a row above the share)
        self.line_names: tuple[str, ...] = ("max_expert_load",) if self.layers else ()

    def _shares(self, metrics: dict[str, float], layer: int) -> list[float]:
        return [metrics[expert_load_name(layer, expert)] for expert in range(self.num_experts)]

    def scalars(self, metrics: dict[str, float]) -> dict[str, float]:
        """``train/max_expert_load``: the largest share any expert got of its layer's slots this step."""
        if not self.layers:
            return {}
        return {"train/max_expert_load": max(max(self._shares(metrics, layer)) for layer in self.layers)}

    def after_step(self, step: int, metrics: dict[str, float]) -> list[str]:
        """The lines of the collapses this step completes (a stretch of ``moe_collapse_steps`` steps)."""
        if self.top_k >= self.num_experts:
            return []
        lines = []
        for layer in self.layers:
            shares = self._shares(metrics, layer)
            expert = max(range(self.num_experts), key=shares.__getitem__)
            token_share = shares[expert] * self.top_k
            if token_share <= self.collapse_share:
                self.streaks.pop(layer, None)
                continue
            previous, steps = self.streaks.get(layer, (expert, 0))
            steps = steps + 1 if previous == expert else 1
            self.streaks[layer] = (expert, steps)
            if steps == self.collapse_steps:
                lines.append(f"router collapse: layer {layer} sent {token_share:.0%} of its tokens to expert "
                             f"{expert} in each of the {steps} steps to {step} (moe_collapse_token_share "
                             f"{self.collapse_share:g}, moe_collapse_steps {self.collapse_steps}); its other "
                             "experts hardly train: moe_load_balancing_loss adds a loss against it")
        return lines
