"""REINFORCE's rollouts (train_impl reinforce): the scored completions the objective trains on, each micro batch
{text, label, reward (the advantage), raw_reward} as GPT-NeoX's online dataset gives them.

Two sources: sampled here (builtin: `reward_function` or `reward_model` names the scorer, reward_function.py /
reward_model_scores.py; prompts from the chat records of train_data_paths) or GPT-NeoX's data server
(data_server: dataset_impl online).
advantages turns a prompt's rewards into advantages (reinforce_advantage), samples makes the tensors,
rollout_log writes what was trained on. Lower packages only: the training loop builds the iterator here.
"""

from __future__ import annotations

from megatron.rollouts.errors import RolloutError

__all__ = ["RolloutError", "rollout_iterators"]


def rollout_iterators(args, engine, iterators, first_iteration: int, data_parallel_rank: int,
                      data_parallel_size: int, tensor_parallel_rank: int = 0, reward_model=None):
    """(train, valid, test) iterators of REINFORCE micro batches; valid and test are not evaluated (None).
    `reward_model`: the frozen engine of `args.reward_model`, built and loaded by the training set-up."""
    import torch

    from megatron.generation import Limits, Sampling
    from megatron.model import build_model
    from megatron.rollouts.advantages import Advantages, advantage_mode
    from megatron.rollouts.builtin import BuiltInRollouts, RolloutShape
    from megatron.rollouts.data_server import ServerRollouts, server_address
    from megatron.rollouts.reward_function import RewardFunction
    from megatron.rollouts.reward_model_scores import RewardModelScores
    from megatron.rollouts.rollout_log import RolloutLog
    from megatron.rollouts.sampler_model import SamplerModel
    from megatron.runtime.initialize import current_device
    from megatron.tokenizer import build_tokenizer

    advantages = Advantages(advantage_mode(args.reinforce_advantage, args.reinforce_leave_one_out))
    if args.dataset_impl == "online":
        host, port = server_address(args.online_dataserver_ips, args.online_dataserver_ports, data_parallel_rank,
                                    data_parallel_size)
        return ServerRollouts(host, port, args.train_micro_batch_size_per_gpu, args.seq_length, advantages), None, None
    tokenizer = build_tokenizer(args)
    shape = RolloutShape(args.reinforce_num_completions, Limits(args.seq_length, args.maximum_tokens, tokenizer.eod),
                         Sampling.of(args), args.gradient_accumulation_steps, args.rollout_samples_shown,
                         args.log_interval)
    generator = torch.Generator(device=current_device())
    generator.manual_seed(args.seed + 1 + data_parallel_rank)  # every tensor-parallel rank draws the same tokens
    log = RolloutLog(args.rollout_log, data_parallel_rank) if args.rollout_log and tensor_parallel_rank == 0 else None
    reward = RewardModelScores(reward_model, tokenizer.eod) if args.reward_model else \
        RewardFunction(args.reward_function)
    sampler = SamplerModel(engine.module, lambda: build_model(args.architecture(), args.seed, lora=args.lora()))
    train = BuiltInRollouts(engine, sampler, iterators[0], tokenizer, reward, advantages, shape,
                            generator, first_iteration, data_parallel_rank, log)
    return train, None, None
