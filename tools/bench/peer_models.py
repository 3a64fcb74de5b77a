"""What the peer benches share: one Hugging Face folder both sides start from, our engine built from it the way a
run builds it (the folder's settings resolved as deepy.py resolves them, its weights through the load plan), the
peer's transformers model of the same folder in a DeepSpeed engine of the same config, and the timed steps.

Both sides take the same batch, the same DeepSpeed config and the same loss (mean next-token cross entropy in
fp32 over the same positions), so the first losses agree up to the precision's rounding: each record carries its
first loss, and a bench prints both, which shows the two sides computed the same thing.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from statistics import median

import yaml
from harness import Ratios, repeat_ratios, step_table, variants_in_fresh_processes, write_json


def save_folder(config, directory: Path, seed: int = 1234) -> Path:
    """A Hugging Face folder of a model of ``config`` (a transformers config) drawn from ``seed``, fp32 safetensors."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    return directory


def batch(options: argparse.Namespace, vocab: int):
    """The one batch every step of either side trains on: micro batch x (seq + 1) tokens, the last as labels."""
    import torch

    return torch.randint(0, vocab, (options.micro_batch, options.seq + 1), generator=torch.Generator().manual_seed(0))


def deepspeed_config(options: argparse.Namespace) -> dict:
    import bench_world as world

    return world.deepspeed_config(options.micro_batch, options.zero_stage, options.precision)


def our_engine(folder: Path, options: argparse.Namespace, scratch: Path, **settings):
    """Our engine of a fine-tune of ``folder`` with ``settings`` (LoRA, for instance): settings resolved from a
    config file as deepy.py resolves them (the vocabulary is the folder's, as its tokenizer would pad it), the
    model built, the folder's weights loaded through the load plan."""
    import bench_world as world

    from megatron.checkpointing import load_checkpoint, plan_load
    from megatron.hf import HF_FOLDER
    from megatron.launch.run_context import settings_for_run
    from megatron.model import build_model
    from megatron.optim.optimizers import build_param_groups

    config = scratch / "run.yml"
    config.write_text(yaml.safe_dump({
        "load": str(folder), "finetune": True, "train_iters": 10, "seq_length": options.seq,
        "train_micro_batch_size_per_gpu": options.micro_batch, "hidden_dropout": 0.0, "attention_dropout": 0.0,
        "embedded_corpus": True, **settings}))
    args = settings_for_run([str(config)]).with_values({"padded_vocab_size": options.vocab}, "bench")
    model = build_model(args.architecture(), args.seed, lora=args.lora())
    engine = world.build_engine(model, deepspeed_config(options), model_parameters=build_param_groups(model, 0.0))
    load_checkpoint(engine, plan_load(args, 1, hf_source=HF_FOLDER))
    return engine


def their_engine(model, options: argparse.Namespace):
    """The peer's ``model`` (transformers, with PEFT's adapters or without) in a DeepSpeed engine of the same
    config, training the parameters that require a gradient, as PEFT's and transformers' guides set it up."""
    import bench_world as world

    return world.build_engine(model, deepspeed_config(options),
                              model_parameters=[p for p in model.parameters() if p.requires_grad], mpu=False)


def our_loss(engine, tokens):
    from megatron.model import causal_lm_loss

    return causal_lm_loss(engine(tokens[:, :-1], parallel_output=True), tokens[:, 1:], vocab_parallel=True)


def their_loss(engine, tokens):
    import torch

    logits = engine(input_ids=tokens[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


def timed_steps(engine, loss_of, tokens, steps: int) -> tuple[float, float]:
    """(the first step's loss, the median of ``steps`` timed optimizer steps after it): forward, loss, backward,
    step on ``tokens``; the first step warms kernels and optimizer state up."""
    def step() -> float:
        loss = loss_of(engine, tokens)
        engine.backward(loss)
        engine.step()
        return loss.item()

    first_loss = step()
    seconds = []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - started)
    return first_loss, median(seconds)


def measure(options: argparse.Namespace, our_settings: dict, their_model: Callable[[str], object]) -> dict:
    """In this process (the bench imported its libraries): ``options.variant``'s engine of the folder (ours with
    ``our_settings``, or ``their_model(folder)``), its timed steps and its peak memory above the RSS before the
    model was built."""
    import bench_world as world
    from procmem import status_kib

    import megatron.model  # noqa: F401  (both sides start with every library imported)

    world.measuring_process(options.threads)
    world.init_world()
    before_kib = status_kib("VmRSS")
    with tempfile.TemporaryDirectory(prefix="bench_peer_") as scratch:
        if options.variant == "ours":
            engine, loss_of = our_engine(Path(options.folder), options, Path(scratch), **our_settings), our_loss
        else:
            engine, loss_of = their_engine(their_model(options.folder), options), their_loss
        first_loss, seconds = timed_steps(engine, loss_of, batch(options, options.vocab), options.steps)
    parameters = list(engine.module.parameters())
    return {"step_seconds": seconds, "peak_mib": (status_kib("VmHWM") - before_kib) / 1024,
            "first_loss": first_loss, "parameters": sum(p.numel() for p in parameters),
            "trained": sum(p.numel() for p in parameters if p.requires_grad)}


def compare(script: str, doc: str, options: argparse.Namespace, config, peer: str, flags: list[str],
            meanings: tuple[str, str], shapes: Callable[[dict, dict], str]) -> None:
    """The parent's part of a peer bench: write the folder of ``config``, measure ``ours`` and ``peer`` in fresh
    processes in turn (``script --variant V flags --folder F``), print the shapes (``shapes(ours, theirs)`` of
    the first records), both first losses, the step table and the two ratios (their ``meanings``: step, memory),
    and write them to ``--json``."""
    variants = ("ours", peer)
    with tempfile.TemporaryDirectory(prefix="bench_peer_") as scratch:
        folder = save_folder(config, Path(scratch) / "hf")
        results, load_average = variants_in_fresh_processes(script, variants, options.repeats,
                                                             [*flags, "--folder", str(folder)])
    times = {variant: [r["step_seconds"] for r in runs] for variant, runs in results.items()}
    peaks = {variant: [r["peak_mib"] for r in runs] for variant, runs in results.items()}
    first_losses = {variant: [r["first_loss"] for r in runs] for variant, runs in results.items()}
    print(f"{shapes(results['ours'][0], results[peer][0])}; repeats {options.repeats}; load average "
          f"{load_average[1]:.2f}")
    print(f"first loss: ours {first_losses['ours'][0]:.6f}, {peer} {first_losses[peer][0]:.6f}")
    print(step_table(times, peaks, variants))
    report = Ratios()
    report.add(f"ours/{peer} step_seconds", median(times["ours"]), median(times[peer]), meanings[0],
               repeat_ratios(times["ours"], times[peer]))
    report.add(f"ours/{peer} peak_rss", median(peaks["ours"]), median(peaks[peer]), meanings[1],
               repeat_ratios(peaks["ours"], peaks[peer]))
    write_json(options, doc, report, load_average, step_seconds=times, peak_mib=peaks, first_loss=first_losses,
               trained_parameters={variant: runs[0]["trained"] for variant, runs in results.items()})
