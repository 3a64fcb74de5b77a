"""A REINFORCE step with rollouts sampled here: how its time splits between sampling (rollout) and the update, and
what the KV cache buys the sampler.

    python tools/bench/bench_rollout_step.py [--layers 4] [--hidden 256] [--heads 8] [--seq 256] [--vocab 4096]
        [--precision fp32|bf16] [--prompts 4] [--completions 4] [--prompt-tokens 32] [--new-tokens 64]
        [--repeats 3] [--threads N] [--json PATH]

One process builds a Llama-family GPTModel in a DeepSpeed engine (Adam) and, every repeat, takes a step as
megatron/rollouts does it: `--prompts` random prompts of `--prompt-tokens` tokens, each completed
`--completions` times (temperature 1, exactly `--new-tokens` tokens: the end-of-document id is out of the
vocabulary's reach), scored by a constant reward with group-normalized advantages, then the REINFORCE loss,
backward and optimizer step on the micro batch. The same completions are also sampled without the KV cache
(every token runs the whole sequence again, generate.py's `recompute`), and by transformers' `generate` on a
LlamaForCausalLM of the same shape (sampling, KV cache, one completion at a time as here, exactly
`--new-tokens` tokens).

| ratio                              | meaning                                                      |
| `rollout/step wall`                | share of the step spent sampling (with the KV cache)         |
| `kv_cache/recompute tokens_per_s`  | generated tokens per second with the cache over without it   |
| `ours/transformers tokens_per_s`   | the rollout sampler's tokens per second over transformers'   |
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Ratios, bench_parser, in_turn, table, write_json  # noqa: E402


def sample_all(model, prompts, options, recompute: bool, generator) -> tuple[list, float]:
    from megatron.generation import Limits, Sampling, complete

    limits = Limits(options.seq, options.new_tokens, eod=-1)  # never drawn: every completion has new_tokens tokens
    started = time.perf_counter()
    completions = [complete(model, prompt, limits, Sampling(temperature=1.0), recompute=recompute,
                            generator=generator) for prompt in prompts for _ in range(options.completions)]
    return completions, time.perf_counter() - started


def transformers_model(options):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        vocab_size=options.vocab, hidden_size=options.hidden, intermediate_size=4 * options.hidden,
        num_hidden_layers=options.layers, num_attention_heads=options.heads, num_key_value_heads=options.heads,
        max_position_embeddings=options.seq, tie_word_embeddings=False)).eval()


def sample_with_transformers(model, prompts, options) -> float:
    import torch

    started = time.perf_counter()
    with torch.no_grad():
        for prompt in prompts:
            for _ in range(options.completions):
                model.generate(torch.tensor([prompt]), do_sample=True, temperature=1.0, top_k=0,
                               max_new_tokens=options.new_tokens, min_new_tokens=options.new_tokens,
                               pad_token_id=0)
    return time.perf_counter() - started


def update(engine, objective, prompts, completions, options) -> float:
    from megatron.rollouts.scored_samples import ScoredCompletion, samples_of

    rows = [ScoredCompletion(prompts[i // options.completions], c.tokens, 1.0, 1.0 if i % 2 else -1.0)
            for i, c in enumerate(completions)]
    started = time.perf_counter()
    loss, _ = objective(engine, samples_of(rows, options.seq))
    engine.backward(loss)
    engine.step()
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> None:
    parser = bench_parser(__doc__, layers=4, hidden=256, heads=8, vocab=4096, seq=256, precision="fp32",
                          repeats=3)
    for flag, default in (("--prompts", 4), ("--completions", 4), ("--prompt-tokens", 32), ("--new-tokens", 64)):
        parser.add_argument(flag, type=int, default=default)
    options = parser.parse_args(argv)
    import bench_world as world
    import torch

    from megatron.data import BatchOptions
    from megatron.model import build_model
    from megatron.neox_arguments import NeoXArgs
    from megatron.objectives.reinforce import Reinforce

    world.measuring_process(options.threads)
    world.init_world()
    before = os.getloadavg()[0]
    micro = options.prompts * options.completions
    args = NeoXArgs.from_dict(world.model_settings(options, **world.LLAMA, mlp_multiple_of=32,
                                                   train_micro_batch_size_per_gpu=micro, train_iters=10))
    model = build_model(args.architecture(), args.seed)
    engine = world.build_engine(model, world.deepspeed_config(micro, 0, options.precision))
    objective = Reinforce(BatchOptions(), "mse", 0.0, True)
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, options.vocab, (options.prompts, options.prompt_tokens), generator=generator).tolist()
    hf = transformers_model(options)
    seconds: dict[str, list[float]] = {"rollout": [], "recompute": [], "transformers": [], "update": []}
    for repeat in range(options.repeats + 1):  # the first is a warm-up
        measured = {}
        for name in in_turn(("rollout", "recompute", "transformers"), repeat):
            if name == "transformers":
                measured[name] = sample_with_transformers(hf, prompts, options)
                continue
            engine.eval()
            sampled, measured[name] = sample_all(engine.module, prompts, options, name == "recompute", generator)
            engine.train()
            completions = sampled  # either way new_tokens tokens each: the update is the same size
        measured["update"] = update(engine, objective, prompts, completions, options)
        if repeat:
            for name, value in measured.items():
                seconds[name].append(value)
    median = {name: statistics.median(values) for name, values in seconds.items()}
    tokens = micro * options.new_tokens
    print(table(["part", "median s", "tokens/s"], [[name, median[name], tokens / median[name] if name != "update"
                                                    else float("nan")] for name in seconds]))
    ratios = Ratios()
    ratios.add("rollout/step wall", median["rollout"], median["rollout"] + median["update"],
               "share of a REINFORCE step spent sampling its completions (KV cache)")
    ratios.add("kv_cache/recompute tokens_per_s", median["recompute"], median["rollout"],
               "generated tokens per second with the KV cache over without it")
    ratios.add("ours/transformers tokens_per_s", median["transformers"], median["rollout"],
               "the rollout sampler's generated tokens per second over transformers' generate on the same shape")
    write_json(options, __doc__, ratios, (before, os.getloadavg()[0]), seconds=seconds, generated_tokens=tokens)


if __name__ == "__main__":
    main()
