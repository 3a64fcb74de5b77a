"""Our model as the LM Evaluation Harness sees it: an `lm_eval.api.model.TemplateLM`.

The harness turns each task into requests; this class answers them with the model's forward:
- loglikelihood: the summed log-probability of a continuation after its context, and whether greedy
  decoding would have produced it (the harness splits the text into tokens, TemplateLM);
- loglikelihood_rolling: the log-probability of a whole text, in windows of `max_length` tokens;
- generate_until: a completion (megatron.generation), cut at the first of the task's stop strings.

Every rank answers as if alone (rank 0 of 1, as GPT-NeoX's adapter says), so the harness gives every
rank the same requests. The data-parallel groups split them (each the requests of its rank) and
gather the answers; within a group the tensor-parallel ranks run the same forwards together. Inputs
longer than `max_length` lose their first tokens, as in the harness's Hugging Face model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from megatron.generation import Limits, Sampling, complete
from megatron.ranks import data_parallel_rank_and_size
from megatron.runtime.collective import all_gather

Request = TypeVar("Request")
Answer = TypeVar("Answer")


def _on_data_parallel_ranks(requests: Sequence[Request], answer: Callable[[list[Request]], list[Answer]]) -> list[Answer]:
    """`answer(requests)`, each data-parallel rank answering every dp_size-th request; the same list on all ranks."""
    rank, size = data_parallel_rank_and_size()
    if size == 1:
        return answer(list(requests))
    mine = list(range(rank, len(requests), size))
    answered: dict[int, Answer] = {}
    for indices, answers in all_gather((mine, answer([requests[i] for i in mine]))):
        answered.update(zip(indices, answers, strict=True))
    return [answered[i] for i in range(len(requests))]


class NeoXLanguageModel(TemplateLM):
    def __init__(self, model, tokenizer, max_length: int, batch_size: int, max_gen_toks: int = 256):
        super().__init__()
        self._model = model  # a GPTModel in eval mode, every tensor-parallel rank's logits gathered
        self._tokenizer = tokenizer  # ours (megatron.tokenizer); the harness reads no tokenizer of its own
        self._max_length = max_length
        self._batch_size = batch_size
        self.max_gen_toks = max_gen_toks
        self._device = next(model.parameters()).device

    @property
    def eot_token_id(self) -> int:
        return self._tokenizer.eod

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self._tokenizer.tokenize(string)

    def tok_decode(self, tokens: list[int]) -> str:
        return self._tokenizer.detokenize(tokens)

    # --- scoring ----------------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        answers = _on_data_parallel_ranks([(context, continuation) for _, context, continuation in requests],
                                          self._score)
        for (cache_key, _, _), answer in zip(requests, answers, strict=True):
            if cache_key is not None:
                self.cache_hook.add_partial("loglikelihood", cache_key, answer)
        return answers

    def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(log-probability of the continuation, greedy) of each (context tokens, continuation tokens)."""
        order = sorted(range(len(pairs)), key=lambda i: -len(pairs[i][0]) - len(pairs[i][1]))  # longest first
        scores: dict[int, tuple[float, bool]] = {}
        for start in range(0, len(order), self._batch_size):
            batch = order[start:start + self._batch_size]
            # the model reads all tokens but the last; the last max_length of them
            inputs = [(pairs[i][0] + pairs[i][1])[-(self._max_length + 1):][:-1] for i in batch]
            padded = torch.zeros(len(batch), len(inputs[0]), dtype=torch.long)
            for row, tokens in enumerate(inputs):
                padded[row, :len(tokens)] = torch.tensor(tokens)  # right padding: causal, earlier positions unchanged
            with torch.no_grad():
                log_probs = F.log_softmax(self._model(padded.to(self._device)).float(), dim=-1).cpu()
            for row, i in enumerate(batch):
                continuation = torch.tensor(pairs[i][1])
                end = len(inputs[row])
                predicted = log_probs[row, end - len(continuation):end]
                chosen = predicted.gather(-1, continuation.unsqueeze(-1)).squeeze(-1)
                scores[i] = (float(chosen.sum()), bool((predicted.argmax(dim=-1) == continuation).all()))
        return [scores[i] for i in range(len(pairs))]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows: list[tuple[list[int], list[int]]] = []
        owners: list[int] = []
        for index, request in enumerate(requests):
            (text,) = request.args
            for window in get_rolling_token_windows(token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                                                    max_seq_len=self._max_length, context_len=1):
                windows.append(make_disjoint_window(window))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (log_prob, _) in zip(owners, _on_data_parallel_ranks(windows, self._score), strict=True):
            totals[owner] += log_prob
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    # --- generation ---------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        texts = _on_data_parallel_ranks([request.args for request in requests], self._generate_each)
        for request, text in zip(requests, texts, strict=True):
            self.cache_hook.add_partial("generate_until", request.args, text)
        return texts

    def _generate_each(self, requests: list[tuple[str, dict[str, Any]]]) -> list[str]:
        return [self._generate(context, dict(gen_kwargs)) for context, gen_kwargs in requests]

    def _generate(self, context: str, gen_kwargs: dict[str, Any]) -> str:
        until = gen_kwargs.pop("until", None) or [self.tok_decode([self.eot_token_id])]
        until = [until] if isinstance(until, str) else list(until)
        maximum_tokens = int(gen_kwargs.pop("max_gen_toks", self.max_gen_toks))
        sampling = (Sampling(float(gen_kwargs.get("temperature") or 0.0), int(gen_kwargs.get("top_k") or 0),
                             float(gen_kwargs.get("top_p") or 0.0))
                    if gen_kwargs.get("do_sample") else Sampling())
        # room for the completion: the context loses its first tokens, as in the harness's HF model
        prompt = self.tok_encode(context)[-max(self._max_length - maximum_tokens, 1):] or [self.eot_token_id]
        # every tensor-parallel rank holds the same tokens, so all of them stop at the same one
        completion = complete(self._model, prompt, Limits(self._max_length, maximum_tokens, self.eot_token_id),
                              sampling, stop=lambda tokens: any(s in self.tok_decode(tokens) for s in until))
        text = self.tok_decode(completion.tokens)
        for stop in until:
            text = text.split(stop)[0]
        return text
