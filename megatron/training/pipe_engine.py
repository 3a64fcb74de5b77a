"""Training through DeepSpeed's pipe engine (pipe_parallel_size > 1): its engine, steps and evaluations.

The pipe engine runs a whole optimizer step (``train_batch``: every micro batch through every stage,
the tied embedding's gradients summed, the step) and a whole evaluation (``eval_batch``) itself; the
first and last stage read the micro batches, each from its own copy of the data-parallel rank's
iterator. The loss it returns is averaged over the micro batches and the data-parallel ranks and the
same on every stage, so the training loop reports it as it reports the one-module loss. With experts the last
stage keeps each micro batch's language-model loss and router statistics (``PipelineLoss``); every stage of its
pipeline gets them, and the objective's metrics (load-balancing loss, every layer's expert load) are computed
and averaged from them as for one module.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from megatron.model.pipeline import (
    build_pipeline_model,
    pipeline_expert_loads,
    pipeline_load_balancing_loss,
    statistics_rows,
)


def is_pipelined(engine) -> bool:
    from deepspeed.runtime.pipe.engine import PipelineEngine

    return isinstance(engine, PipelineEngine)


def build_pipeline_engine(args, ds_config: dict):
    """This rank's stage in DeepSpeed's pipe engine, over the topology of megatron-core's groups."""
    import deepspeed

    from megatron.optim.optimizers import build_param_groups

    module = build_pipeline_model(args.architecture(), args.seed, args.pipe_parallel_size, args.pipe_partition_method,
                                  args.lora())
    if args.architecture().splits_sequence:
        # The pipe engine sends 1/tp of the first tensor from each tensor-parallel rank and joins the slices on the
        # next stage, which holds only where every rank sends the same tensor; with the sequence split each rank
        # sends its own part whole.
        ds_config = {**ds_config, "pipeline": {**ds_config.get("pipeline", {}), "pipe_partitioned": False,
                                               "grad_partitioned": False}}
    engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=build_param_groups(module, args.weight_decay),
                                           config=ds_config)
    return engine


def pipeline_batches(iterator: Iterator[dict], batch_options) -> Iterator[tuple[tuple, tuple]]:
    """The pipe engine's (inputs, labels) micro batches from the data iterator's samples, read as they are asked for."""
    from megatron.data import get_batch
    from megatron.runtime.initialize import current_device

    for samples in iterator:
        batch = get_batch(samples, batch_options).to(current_device())
        positions = batch.position_ids
        if positions is None:
            positions = torch.arange(batch.tokens.shape[1], device=batch.tokens.device).expand_as(batch.tokens)
        mask = () if batch.attention_mask is None else (batch.attention_mask,)
        yield (batch.tokens, positions.contiguous(), *mask), (batch.labels, batch.loss_mask)


def train_step(engine, train_iterator, objective, before_optimizer_step=None) -> tuple[float, dict[str, float]]:
    """``training.train_step`` through the pipe engine."""
    loss = engine.train_batch(pipeline_batches(train_iterator, objective.batch_options))
    return float(loss), _averaged(_micro_batch_metrics(engine, objective))


@torch.no_grad()
def evaluate(engine, iterator, eval_iters: int, objective) -> tuple[float, dict[str, float]]:
    """``training.evaluate`` through the pipe engine: the mean loss of ``eval_iters`` batches of
    gradient_accumulation_steps micro batches (one ``eval_batch`` each, as GPT-NeoX evaluates a pipeline)."""
    batches = pipeline_batches(iterator, objective.batch_options)
    losses, results = [], []
    for _ in range(eval_iters):
        losses.append(float(engine.eval_batch(batches)))
        results += _micro_batch_metrics(engine, objective)
    return sum(losses) / eval_iters, _averaged(results)


def _averaged(results: list[tuple[torch.Tensor, dict]]) -> dict[str, float]:
    from megatron.objectives import mean_over_micro_batches_and_ranks

    return mean_over_micro_batches_and_ranks(results)[1] if results else {}


def _micro_batch_metrics(engine, objective) -> list[tuple[torch.Tensor, dict]]:
    """The objective's (loss, metrics) of each micro batch the pipe engine just ran, on every rank, from the
    language-model loss and router statistics the last stage of this rank's pipeline kept (none without experts)."""
    import torch.distributed as dist

    from megatron.core import parallel_state
    from megatron.runtime.initialize import current_device

    arch = objective.experts
    if arch is None:
        return []
    shape = (statistics_rows(arch), arch.moe_num_experts)
    kept = torch.zeros(engine.micro_batches, 2 + shape[0] * shape[1], device=current_device())
    if engine.is_last_stage():
        loss_fn = engine.module.loss_fn
        for row, (lm_loss, statistics, tokens) in enumerate(loss_fn.kept):
            kept[row, 0], kept[row, 1], kept[row, 2:] = lm_loss, tokens, statistics.reshape(-1)
        loss_fn.kept.clear()
    dist.broadcast(kept, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                   group=parallel_state.get_pipeline_model_parallel_group())
    results = []
    for row in kept:
        lm_loss, tokens, statistics = row[0], int(row[1]), row[2:].reshape(shape)
        results.append(objective.with_experts(lm_loss, pipeline_load_balancing_loss(statistics, tokens, arch),
                                              pipeline_expert_loads(statistics, tokens, arch)))
    return results
