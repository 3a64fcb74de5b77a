"""Complete one prompt token by token, as GPT-NeoX's generate.py does.

Tokens are generated until the end-of-document token (not part of the completion; the completion is
then `finished`), `maximum_tokens` of them, the sequence reaching `seq_length`, or a caller's stop
rule (eval.py's stop strings) holding. Without `recompute` the model keeps the keys and values of
the tokens it has run (KVCache), so each step after the first runs one token; with it, every step
runs the whole sequence again. At tensor-parallel size > 1 every rank of the group computes the
gathered logits; the token tensor-parallel rank 0 chose is the one all of them continue with, so
sampling cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron.generation.sampling import Sampling, next_tokens


@dataclass(frozen=True)
class Completion:
    tokens: list[int]  # the generated tokens, without the prompt and without a final end-of-document token
    finished: bool  # ended by the end-of-document token
    # log p of each chosen token under the model (its softmax, before temperature, top_k and top_p), the
    # end-of-document token's last when finished
    log_probs: tuple[float, ...] = ()


@dataclass(frozen=True)
class Limits:
    seq_length: int
    maximum_tokens: int
    eod: int


def _same_on_every_tensor_parallel_rank(token: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized() or parallel_state.get_tensor_model_parallel_world_size() == 1:
        return token
    dist.broadcast(token, parallel_state.get_tensor_model_parallel_src_rank(),
                   group=parallel_state.get_tensor_model_parallel_group())
    return token


@torch.no_grad()
def complete(model, prompt: list[int], limits: Limits, sampling: Sampling, recompute: bool = False,
             stop: Callable[[list[int]], bool] | None = None, generator: torch.Generator | None = None) -> Completion:
    """The completion of `prompt` (token ids, at least one) by `model` (a GPTModel in eval mode); it also
    ends (not finished) after the first token for which `stop(tokens generated so far)` holds. Tokens are drawn
    from `generator` (on the model's device) when given, else from torch's default one."""
    from megatron.model import KVCache

    device = next(model.parameters()).device
    sequence = torch.tensor([prompt], dtype=torch.long, device=device)
    steps = min(limits.maximum_tokens, limits.seq_length - len(prompt))
    cache = None if recompute else KVCache(model.arch.num_layers)
    generated: list[int] = []
    log_probs: list[float] = []
    for _ in range(max(steps, 0)):
        if cache is None:
            logits = model(sequence)
        else:
            logits = model(sequence[:, cache.length:], kv_cache=cache)
        token = _same_on_every_tensor_parallel_rank(next_tokens(logits[:, -1], sampling, generator))
        log_probs.append(torch.log_softmax(logits[0, -1].float(), dim=-1)[token.item()].item())
        if token.item() == limits.eod:
            return Completion(generated, finished=True, log_probs=tuple(log_probs))
        generated.append(token.item())
        if stop is not None and stop(generated):
            break
        sequence = torch.cat((sequence, token.view(1, 1)), dim=1)
    return Completion(generated, finished=False, log_probs=tuple(log_probs))
