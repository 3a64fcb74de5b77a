"""Every local expert's MLP in one grouped computation: the routed (token, expert) pairs sorted by expert with
one stable argsort, each projection one ``torch._grouped_mm`` over the stacked expert weights, the outputs put
back in each token's order and added up.

The results are the per-expert loop's (megatron/model/moe.py): each pair's output is weighed by its routing
weight in the same dtypes, and a token's outputs are added in ascending expert order starting from zero, as
the loop's ``index_add_`` adds them. Whether the grouped matmul runs is decided once per device, dtype and
shape, by running it forward and backward on a few rows of that shape (``grouped_matmul_runs``); where it
does not (a torch without it, a device or dtype it lacks, or rows whose strides it refuses) the loop runs.
"""

from __future__ import annotations

import functools

import torch

from megatron.logging import get_logger


@functools.cache
def grouped_matmul_runs(device: torch.device, dtype: torch.dtype, hidden: int, width: int) -> bool:
    """Whether ``torch._grouped_mm`` runs, with its gradient, on two groups of rows ``hidden`` -> ``width`` ->
    ``hidden`` wide on ``device`` in ``dtype``. Said once per combination (rank 0)."""
    runs = hasattr(torch, "_grouped_mm")
    if runs:
        # The first expert layer may ask inside activation recomputation's forward (whose saved-tensor hooks would
        # recompute the layer when the probe's backward unpacks them) or under no_grad (evaluation, generation):
        # the probe keeps its own tensors and its own gradient.
        keep = (lambda tensor: tensor, lambda tensor: tensor)
        try:
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(*keep):
                rows = torch.ones(4, hidden, device=device, dtype=dtype, requires_grad=True)
                up = torch.ones(2 * width, hidden, device=device, dtype=dtype, requires_grad=True)
                offsets = torch.tensor([1, 4], device=device, dtype=torch.int32)
                inner = torch._grouped_mm(rows, up.view(2, width, hidden).transpose(1, 2), offs=offsets)
                out = torch._grouped_mm(inner, up.view(2, width, hidden), offs=offsets)
                out.backward(torch.ones_like(out))  # a whole gradient, as the weighing of the outputs passes back
        except (RuntimeError, NotImplementedError):
            runs = False
    path = "grouped (torch._grouped_mm)" if runs else "one expert after another (no grouped matmul here)"
    get_logger().info(f"mixture of experts: the experts run {path} on {device.type} in {dtype}")
    return runs


def sort_by_expert(chosen: torch.Tensor, local: range) -> tuple[torch.Tensor, torch.Tensor]:
    """For ``chosen`` [pairs] (each pair's expert): the pairs of ``local``'s experts in expert order (a stable
    sort: by pair within an expert), and the grouped matmul's offsets, the end of each local expert's rows."""
    order = torch.argsort(chosen, stable=True)
    counts = torch.bincount(chosen, minlength=local.stop)
    ends = torch.cumsum(counts, 0)
    first, last = (ends[local.start] - counts[local.start]), ends[local.stop - 1]
    local_pairs = order[first:last]
    offsets = (ends[local.start:local.stop] - first).to(torch.int32)
    return local_pairs, offsets


def grouped_experts(mlp, tokens: torch.Tensor, weights_by_choice: torch.Tensor, chosen_by_choice: torch.Tensor,
                    out_dtype: torch.dtype) -> torch.Tensor:
    """The local experts' weighted outputs summed per token, [tokens, hidden] in ``out_dtype``.

    ``mlp`` is the layer's ExpertWeights; ``chosen_by_choice`` [top_k, tokens] each token's experts and
    ``weights_by_choice`` their routing weights, as the loop takes them. Each expert's rows are in the loop's
    order (by choice, then token), so that its weights' gradients add up the same rows in the same order."""
    top_k, count = chosen_by_choice.shape
    pairs, offsets = sort_by_expert(chosen_by_choice.reshape(-1), mlp.local)
    rows = tokens[pairs % count]
    experts, width, hidden = len(mlp.local), mlp.width, tokens.shape[-1]
    w1, w3, w2 = mlp.weights()  # with LoRA on the experts, their adapters added
    inner = mlp.activation(torch._grouped_mm(rows, w1.view(experts, width, hidden).transpose(1, 2), offs=offsets))
    if mlp.gated:
        inner = inner * torch._grouped_mm(rows, w3.view(experts, width, hidden).transpose(1, 2), offs=offsets)
    outputs = torch._grouped_mm(inner, w2.view(experts, width, hidden), offs=offsets)
    weighted = (outputs * weights_by_choice.reshape(-1)[pairs, None]).to(out_dtype)
    # pairs of other ranks' experts add nothing here: zero, as the loop leaves them
    by_pair = weighted.new_zeros(top_k * count, hidden).index_copy(0, pairs, weighted).view(top_k, count, hidden)
    # a token's outputs added in ascending expert order, as the loop adds them
    ascending, token = chosen_by_choice.argsort(dim=0), torch.arange(count, device=tokens.device)
    out = by_pair[ascending[0], token]
    for place in range(1, top_k):
        out = out + by_pair[ascending[place], token]
    return out
