"""Training step: ours against Hugging Face transformers with the same shapes and DeepSpeed config.

    python tools/bench/bench_train_step.py [--family neox llama] [--precision fp32 bf16]
        [--layers 6] [--hidden 512] [--heads 8] [--kv-heads 4] [--seq 512] [--batch 4] [--vocab 8192]
        [--zero-stage 1] [--repeats 5] [--threads N] [--compile none|ours|both] [--json PATH]

For each family and precision, one process builds our GPTModel and the matching transformers model
(GPTNeoXForCausalLM: rotary on a quarter of each head, parallel residual, exact GELU; or
LlamaForCausalLM: RMSNorm, SwiGLU, grouped-query attention; untied, no dropout, SDPA attention),
each inside its own DeepSpeed engine with the same config (Adam, the given ZeRO stage). Both take
the same token batch and the same loss (``causal_lm_loss`` on the logits). After one warm-up step
each, every repeat times one step (forward, loss, backward, optimizer step) of each model, the
order alternating. Prints the median step time, tokens/s, and ``RATIO ours/hf tokens_per_s`` (above
1: ours is faster) with the spread of the per-repeat ratios, and the share of one profiled step of
each model spent in matrix products and attention kernels (the work both models share); ``--json``
writes the same as JSON.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_world as world  # noqa: E402
import torch  # noqa: E402
from deepspeed.accelerator import get_accelerator  # noqa: E402
from harness import Ratios, bench_parser, in_turn, repeat_ratios, table, write_json  # noqa: E402

from megatron.model import build_model, causal_lm_loss  # noqa: E402
from megatron.neox_arguments import NeoXArgs  # noqa: E402


def our_model(family: str, options: argparse.Namespace) -> torch.nn.Module:
    if family == "llama":  # the MLP width rounded as Llama's configs round it
        settings = world.model_settings(options, **world.LLAMA, num_kv_heads=options.kv_heads, mlp_multiple_of=256)
    else:
        settings = world.model_settings(options, **world.PYTHIA)
    args = NeoXArgs.from_dict(settings)
    return build_model(args.architecture(), args.seed)


def hf_model(family: str, options: argparse.Namespace, mlp_width: int) -> torch.nn.Module:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig, LlamaForCausalLM

    common = {"vocab_size": options.vocab, "hidden_size": options.hidden, "num_hidden_layers": options.layers,
              "num_attention_heads": options.heads, "intermediate_size": mlp_width,
              "max_position_embeddings": options.seq, "tie_word_embeddings": False}
    torch.manual_seed(1234)
    if family == "llama":
        config = LlamaConfig(num_key_value_heads=options.kv_heads, attention_dropout=0.0, **common)
        model_class = LlamaForCausalLM
    else:
        config = GPTNeoXConfig(rotary_pct=0.25, use_parallel_residual=True, hidden_act="gelu", hidden_dropout=0.0,
                               attention_dropout=0.0, **common)
        model_class = GPTNeoXForCausalLM
    config._attn_implementation = "sdpa"
    return model_class(config)


def mlp_width(model: torch.nn.Module) -> int:
    """The MLP inner width our model built (linear2's input), for the transformers model to match."""
    return model.layers[0].mlp.linear2.weight.shape[1]


def engine_for(model: torch.nn.Module, precision: str, options: argparse.Namespace):
    config = world.deepspeed_config(options.batch, options.zero_stage, precision, gradient_clipping=1.0)
    return world.build_engine(model, config, mpu=False)


def step_seconds(engine, tokens: torch.Tensor, hugging_face: bool) -> float:
    accelerator = get_accelerator()
    accelerator.synchronize()  # on a GPU the step's kernels run asynchronously: time them, not their launch
    started = time.perf_counter()
    output = engine(tokens[:, :-1])
    logits = output.logits if hugging_face else output
    loss = causal_lm_loss(logits, tokens[:, 1:])
    engine.backward(loss)
    engine.step()
    accelerator.synchronize()
    return time.perf_counter() - started


# Dense bf16 tensor-core peak per GPU (the vendors' data sheets, without sparsity), by torch's device name.
BF16_PEAK_TFLOPS = {"H200": 989.4, "H100 SXM": 989.4, "H100 80GB HBM3": 989.4, "H100 PCIe": 756.0,
                    "A100": 312.0, "L40S": 362.1, "A10G": 70.0}


def bf16_peak_flops(device_name: str, given_tflops: float | None) -> float | None:
    if given_tflops:
        return given_tflops * 1e12
    matches = [tflops for name, tflops in BF16_PEAK_TFLOPS.items() if name in device_name]
    return matches[0] * 1e12 if matches else None


def model_flops_per_token(parameters: int, options: argparse.Namespace) -> float:
    """Training FLOPs per token as PaLM's appendix counts them: 6 per parameter and 12 x layers x hidden x
    sequence for attention's scores and values (forward and backward), no recomputation."""
    return 6.0 * parameters + 12.0 * options.layers * options.hidden * options.seq


# Matrix products and attention (whose CPU kernels are matrix products): the FLOPs both models share.
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear",
              "aten::_scaled_dot_product_flash_attention_for_cpu",
              "aten::_scaled_dot_product_flash_attention_for_cpu_backward")


def matmul_share_of_step(engine, tokens: torch.Tensor, hugging_face: bool) -> float:
    """Share of one profiled step's CPU time (self time of every op) spent in MATMUL_OPS."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        step_seconds(engine, tokens, hugging_face)
    events = profile.key_averages()
    total = sum(event.self_cpu_time_total for event in events)
    return sum(event.self_cpu_time_total for event in events if event.key in MATMUL_OPS) / total


def measure(family: str, precision: str, options: argparse.Namespace) -> dict:
    ours = our_model(family, options)
    width = mlp_width(ours)
    engines = {"ours": engine_for(ours, precision, options),
               "hf": engine_for(hf_model(family, options, width), precision, options)}
    for name in {"ours": ["ours"], "both": ["ours", "hf"]}.get(options.compile, []):
        engines[name].compile()  # what `torch_compile: true` does; the warm-up step below pays the compile time
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, options.vocab, (options.batch, options.seq + 1), generator=generator)
    tokens = tokens.to(engines["ours"].device)
    for name, engine in engines.items():
        step_seconds(engine, tokens, name == "hf")  # warm-up: kernels, optimizer state
    times: dict[str, list[float]] = {"ours": [], "hf": []}
    peak_bytes = dict.fromkeys(times, 0)  # the process's peak accelerator memory during each model's steps
    accelerator = get_accelerator()
    for repeat in range(options.repeats):
        for name in in_turn(["ours", "hf"], repeat):
            accelerator.reset_peak_memory_stats()
            times[name].append(step_seconds(engines[name], tokens, name == "hf"))
            peak_bytes[name] = max(peak_bytes[name], accelerator.max_memory_allocated())
    matmul_share = {name: None if options.no_profile else matmul_share_of_step(engine, tokens, name == "hf")
                    for name, engine in engines.items()}
    parameters = {name: sum(p.numel() for p in engine.module.parameters()) for name, engine in engines.items()}
    tokens_per_step = options.batch * options.seq
    paired = repeat_ratios(times["hf"], times["ours"])
    tokens_per_second = {name: tokens_per_step / median(values) for name, values in times.items()}
    on_cpu = accelerator.device_name() == "cpu"
    peak = bf16_peak_flops("" if on_cpu else getattr(torch, accelerator.device_name()).get_device_name(),
                           options.peak_tflops)
    mfu = {name: tokens_per_second[name] * model_flops_per_token(parameters[name], options) / peak
           for name in times} if peak else None
    return {
        "family": family, "precision": precision, "parameters": parameters, "mlp_width": width,
        "device": accelerator.device_name(), "peak_memory_bytes": peak_bytes, "mfu_of_bf16_peak": mfu,
        "step_seconds": times, "tokens_per_step": tokens_per_step,
        "tokens_per_second": tokens_per_second,
        "ratio": median(times["hf"]) / median(times["ours"]), "per_repeat_ratio": paired,
        "matmul_share": matmul_share,
        "ratio_spread": [min(paired), max(paired)],
    }


@world.leaves_the_world
def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, layers=6, hidden=512, heads=8, vocab=8192, seq=512, zero_stage=1, repeats=5)
    parser.add_argument("--family", nargs="+", choices=("neox", "llama"), default=["neox", "llama"])
    parser.add_argument("--precision", nargs="+", choices=("fp32", "bf16", "fp16"), default=["fp32", "bf16"])
    parser.add_argument("--kv-heads", type=int, default=4, help="key/value heads of the Llama family")
    parser.add_argument("--batch", type=int, default=4, help="micro batch")
    parser.add_argument("--compile", choices=("none", "ours", "both"), default="none",
                        help="torch.compile (engine.compile, what `torch_compile: true` does) ours or both models")
    parser.add_argument("--peak-tflops", type=float, help="the GPU's dense bf16 peak for model FLOPs utilisation "
                        "(default: from its name, see BF16_PEAK_TFLOPS)")
    parser.add_argument("--no-profile", action="store_true", help="skip the CPU profile of the matmul share")
    options = parser.parse_args(argv)
    world.measuring_process(options.threads, return_freed_memory=False)
    world.init_world()

    load_before = os.getloadavg()[0]
    results = [measure(family, precision, options) for family in options.family for precision in options.precision]
    load_after = os.getloadavg()[0]

    print(f"shapes: {options.layers} layers, hidden {options.hidden}, {options.heads} heads, vocab {options.vocab}, "
          f"batch {options.batch} x {options.seq} tokens; DeepSpeed ZeRO stage {options.zero_stage}, Adam; "
          f"compiled (engine.compile): {options.compile}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs; repeats "
          f"{options.repeats}; load average before {load_before:.2f}, after {load_after:.2f}")
    rows = [[r["family"], r["precision"], f"{r['parameters']['ours'] / 1e6:.1f}M", 1e3 * median(r["step_seconds"]["ours"]),
             1e3 * median(r["step_seconds"]["hf"]), r["tokens_per_second"]["ours"], r["tokens_per_second"]["hf"],
             r["ratio"], f"{r['ratio_spread'][0]:.2f}-{r['ratio_spread'][1]:.2f}", r["matmul_share"]["ours"],
             r["matmul_share"]["hf"]] for r in results]
    print(table(["family", "precision", "params", "ours ms", "hf ms", "ours tok/s", "hf tok/s", "ours/hf",
                 "per-repeat", "ours matmul share", "hf matmul share"], rows))
    ratios = Ratios()
    for r in results:
        if r["device"] != "cpu":
            for name in ("ours", "hf"):
                mfu = r["mfu_of_bf16_peak"]
                print(f"{name} {r['family']} {r['precision']}: {r['tokens_per_second'][name]:,.0f} tokens/s, "
                      f"model FLOPs utilisation {f'{100 * mfu[name]:.1f}%' if mfu else 'unknown (give --peak-tflops)'}"
                      f" of the bf16 peak, peak memory {r['peak_memory_bytes'][name] / 2**30:.1f} GiB")
        ratios.add(f"ours/hf tokens_per_s {r['family']} {r['precision']}", r["tokens_per_second"]["ours"],
                   r["tokens_per_second"]["hf"], "training-step throughput; above 1: ours is faster",
                   r["per_repeat_ratio"])
    write_json(options, __doc__, ratios, (load_before, load_after), results=results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
