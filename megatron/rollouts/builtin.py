"""Rollouts sampled here: each micro batch of chat samples gives its prompts (each cut before its first trained
label); the policy being trained, as it is now (eval mode: no dropout; under ZeRO-3 a whole copy of it,
sampler_model.py), samples `completions_per_prompt` completions of each with generate.py's settings and KV cache;
the reward function or the reward model scores them; each prompt's completions get their advantages. A completion
ends at the end-of-document token (kept: it is trained, so the policy learns where to stop) or after
maximum_tokens (or at seq_length). With `shown` > 0 the logging rank prints that many of them at the first micro
batch of every log_interval-th step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron.generation import Limits, Sampling, complete
from megatron.rollouts.advantages import Advantages
from megatron.rollouts.errors import RolloutError
from megatron.rollouts.rollout_log import RolloutLog
from megatron.rollouts.sampler_model import SamplerModel
from megatron.rollouts.scored_samples import ScoredCompletion, prompt_of, samples_of


@dataclass(frozen=True)
class RolloutShape:
    completions_per_prompt: int
    limits: Limits
    sampling: Sampling
    gradient_accumulation_steps: int
    shown: int = 0  # rollout_samples_shown
    log_interval: int = 1


class BuiltInRollouts:
    """An iterator of the objective's micro batches: micro batch size x completions_per_prompt scored completions."""

    def __init__(self, engine, sampler: SamplerModel, prompt_batches, tokenizer, reward, advantages: Advantages,
                 shape: RolloutShape, generator: torch.Generator, first_iteration: int, data_parallel_rank: int,
                 log: RolloutLog | None):
        self.engine = engine
        self.sampler = sampler
        self.prompt_batches = prompt_batches
        self.tokenizer = tokenizer
        self.reward = reward
        self.advantages = advantages
        self.shape = shape
        self.generator = generator
        self.micro_batches = first_iteration * shape.gradient_accumulation_steps
        self.rank = data_parallel_rank
        self.log = log

    def __iter__(self):
        return self

    def state_dict(self) -> dict:
        """What a resume needs to sample the unbroken run's rollouts (the prompts follow the data position)."""
        return {"generator": self.generator.get_state(), "advantages": self.advantages.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
        self.advantages.load_state_dict(state["advantages"])

    def __next__(self) -> dict[str, torch.Tensor]:
        samples = next(self.prompt_batches)
        prompts = [self._prompt(text, label) for text, label in zip(samples["text"], samples["label"], strict=True)]
        self.engine.eval()
        try:
            model = self.sampler.current()
            groups = [[complete(model, prompt, self.shape.limits, self.shape.sampling,
                                generator=self.generator) for _ in range(self.shape.completions_per_prompt)]
                      for prompt in prompts]
        finally:
            self.engine.train()
        completion_ids = [completion.tokens + ([self.shape.limits.eod] if completion.finished else [])
                          for group in groups for completion in group]
        prompt_ids = [prompt for prompt in prompts for _ in range(self.shape.completions_per_prompt)]
        prompt_texts = [self.tokenizer.readable_text(ids) for ids in prompt_ids]
        texts = [self.tokenizer.readable_text(ids) for ids in completion_ids]
        rewards = self.reward(prompts=prompt_texts, completions=texts, prompt_ids=prompt_ids,
                              completion_ids=completion_ids)
        k = self.shape.completions_per_prompt
        advantages = [a for start in range(0, len(rewards), k) for a in self.advantages.of_group(rewards[start:start + k])]
        rows = [ScoredCompletion(p, c, r, a) for p, c, r, a in zip(prompt_ids, completion_ids, rewards, advantages,
                                                                    strict=True)]
        if self.log is not None:
            log_probs = [sum(completion.log_probs) for group in groups for completion in group]
            self.log.write(self._records(rows, log_probs, prompt_texts, texts))
        self._show(prompt_texts, texts, rewards)
        self.micro_batches += 1
        return samples_of(rows, self.shape.limits.seq_length)

    def _show(self, prompt_texts: list[str], texts: list[str], rewards: list[float]) -> None:
        gas = self.shape.gradient_accumulation_steps
        iteration = self.micro_batches // gas + 1
        if not self.shape.shown or self.micro_batches % gas or iteration % self.shape.log_interval:
            return
        from megatron.logging import get_logger

        for index, (prompt, text, reward) in enumerate(zip(prompt_texts, texts, rewards, strict=True)):
            if index == self.shape.shown:
                break
            get_logger().info(f"rollout sample {index + 1} of iteration {iteration} | reward {reward:.4f} | prompt "
                              f"{prompt!r} | completion {text!r}")

    def _prompt(self, text: torch.Tensor, label: torch.Tensor) -> list[int]:
        prompt = prompt_of(text, label)
        if prompt is None:
            raise RolloutError("train_label_data_paths: a chat sample has no trained label, so it has no prompt to "
                               "complete; make the data with the chat preprocess tool, which labels the answers")
        if len(prompt) >= self.shape.limits.seq_length:
            raise RolloutError(f"a prompt has {len(prompt)} tokens, which leaves no room to complete it within "
                               f"seq_length={self.shape.limits.seq_length}; raise seq_length or shorten the chats")
        return prompt

    def _records(self, rows: list[ScoredCompletion], log_probs: list[float], prompt_texts: list[str],
                 texts: list[str]) -> list[dict]:
        gas = self.shape.gradient_accumulation_steps
        iteration, micro_batch = self.micro_batches // gas + 1, self.micro_batches % gas
        return [{"iteration": iteration, "rank": self.rank, "micro_batch": micro_batch,
                 "group": index // self.shape.completions_per_prompt, "prompt_ids": row.prompt_ids,
                 "completion_ids": row.completion_ids, "reward": row.reward, "advantage": row.advantage,
                 "logp": log_prob, "prompt": prompt, "completion": text}
                for index, (row, log_prob, prompt, text) in enumerate(zip(rows, log_probs, prompt_texts, texts,
                                                                          strict=True))]
