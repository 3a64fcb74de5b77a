"""Module-only load: ours (read_module_weights + load_module_only) against DeepSpeed's own, in one process.

    python tools/bench/bench_module_only_load.py [--layers 4] [--hidden 512] [--vocab 16384]
        [--precision bf16] [--zero-stage 1] [--repeats 5] [--batch 1] [--seq 32] [--threads N]

Builds a GPTModel inside a real DeepSpeed engine (one-rank gloo world), saves one checkpoint with
save_engine_checkpoint, then, alternating the order every repeat, measures:

* baseline: ``engine.load_checkpoint(dir, tag, load_module_only=True, load_optimizer_states=False,
  load_lr_scheduler_states=False)``;
* ours: ``read_module_weights(tag_dir)`` + ``load_module_only(engine, weights)`` (master refresh and
  ``verify_master_weights`` included);
* ``verify_master_weights(engine)`` alone, against one training step (forward + backward + step).

A training step runs before every load so each load has changed weights to overwrite; after the
first load of each kind the engine's weights are checked against the checkpoint. Prints medians
(wall and process CPU time), peak RSS growth during each load, and ``RATIO`` lines.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import deepspeed  # noqa: E402
import torch  # noqa: E402
from deepspeed.utils import logger as deepspeed_logger  # noqa: E402
from procmem import MemoryDelta, measure_memory, median, ratio_line, return_freed_memory_to_os, table  # noqa: E402
from single_rank import init_single_rank_world  # noqa: E402

from megatron.checkpointing import layout  # noqa: E402
from megatron.checkpointing.engine_save import save_engine_checkpoint  # noqa: E402
from megatron.checkpointing.master_weights import verify_master_weights  # noqa: E402
from megatron.checkpointing.module_load import load_module_only  # noqa: E402
from megatron.checkpointing.module_weights import load_checkpoint_file, read_module_weights  # noqa: E402
from megatron.model import build_model, causal_lm_loss  # noqa: E402
from megatron.neox_arguments import NeoXArgs  # noqa: E402

TAG = "global_step1"
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class Samples:
    wall_s: list[float] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)
    memory: list[MemoryDelta] = field(default_factory=list)

    def timed(self, call, with_memory: bool = False):
        gc.collect()
        wall, cpu = time.perf_counter(), time.process_time()
        if with_memory:
            result, delta = measure_memory(call)
            self.memory.append(delta)
        else:
            result = call()
        self.wall_s.append(time.perf_counter() - wall)
        self.cpu_s.append(time.process_time() - cpu)
        return result

    def row(self, name: str) -> list[object]:
        peak = median([m.peak_growth_mib for m in self.memory]) if self.memory else "-"
        kept = median([m.retained_mib for m in self.memory]) if self.memory else "-"
        return [name, median(self.wall_s) * 1e3, median(self.cpu_s) * 1e3, peak, kept]


def build_engine(options: argparse.Namespace):
    args = NeoXArgs.from_dict(
        {
            "num_layers": options.layers,
            "hidden_size": options.hidden,
            "num_attention_heads": options.heads,
            "seq_length": options.seq,
            "max_position_embeddings": options.seq,
            "hidden_dropout": 0.0,
            "attention_dropout": 0.0,
            "seed": 1234,
        }
    )
    args.padded_vocab_size = options.vocab
    model = build_model(args)
    config = {
        "train_micro_batch_size_per_gpu": options.batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": options.zero_stage},
        "steps_per_print": 10**9,
    }
    if options.precision != "fp32":
        config[options.precision] = {"enabled": True}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def train_step(engine, tokens: torch.Tensor) -> None:
    loss = causal_lm_loss(engine(tokens[:, :-1]), tokens[:, 1:])
    engine.backward(loss)
    engine.step()


def trained_weights(engine) -> dict[str, torch.Tensor]:
    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        return {name: p.data.detach().cpu().clone() for name, p in params.items()}


def check_loaded(engine, checkpoint: dict[str, torch.Tensor], what: str) -> None:
    """The engine holds the checkpoint's weights (cast to the training dtype); a load that did nothing fails."""
    for name, value in trained_weights(engine).items():
        if not torch.equal(value, checkpoint[name].to(value.dtype)):
            raise SystemExit(f"{what}: parameter {name} differs from the checkpoint after the load")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=16384, help="padded vocabulary size")
    parser.add_argument("--precision", choices=sorted(DTYPES), default="bf16",
                        help="fp16 needs an accelerator that supports it (DeepSpeed's CPU one refuses it)")
    parser.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=1, help="micro batch of the training step")
    parser.add_argument("--seq", type=int, default=32, help="sequence length of the training step")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--dir", type=Path, help="checkpoint directory (default: a temporary one)")
    parser.add_argument("--json", type=Path, help="also write the results here as JSON")
    options = parser.parse_args(argv)
    malloc_returns_memory = return_freed_memory_to_os()
    if options.threads:
        torch.set_num_threads(options.threads)
    deepspeed_logger.setLevel("WARNING")
    init_single_rank_world()

    engine = build_engine(options)
    n_params = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in engine.module.parameters())
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, options.vocab, (options.batch, options.seq + 1), generator=generator)
    tokens = tokens.to(engine.device)
    train_step(engine, tokens)  # warm-up, and optimizer state exists as in a real run

    with tempfile.TemporaryDirectory(prefix="bench_module_only_") as scratch:
        save_dir = options.dir or Path(scratch)
        tag_dir = save_engine_checkpoint(engine, save_dir, TAG, {"iteration": 1})
        checkpoint = {k: v.clone() for k, v in read_module_weights(tag_dir).items()}
        files_mib = sum(p.stat().st_size for p in tag_dir.iterdir() if p.is_file()) / 2**20

        def baseline():
            path, _ = engine.load_checkpoint(str(save_dir), TAG, load_module_only=True,
                                             load_optimizer_states=False, load_lr_scheduler_states=False)
            if path is None:
                raise SystemExit(f"DeepSpeed's load_checkpoint loaded nothing from {save_dir}/{TAG}")

        def ours():
            load_module_only(engine, read_module_weights(tag_dir), strict=True)

        def raw():
            state = load_checkpoint_file(tag_dir / layout.model_states_name(0))["module"]
            engine.module.load_state_dict(state, strict=False)  # without the megatron-core _extra_state keys

        loads = [("baseline", baseline), ("ours", ours)]
        if options.zero_stage < 3:  # a ZeRO-3 module holds partitions; load_state_dict cannot fill them
            loads.append(("raw", raw))
        samples = {name: Samples() for name in [name for name, _ in loads] + ["verify", "train_step"]}
        load_before = os.getloadavg()
        for repeat in range(options.repeats):
            for name, load in loads if repeat % 2 == 0 else loads[::-1]:
                samples["train_step"].timed(lambda: train_step(engine, tokens))
                samples[name].timed(load, with_memory=True)
                if repeat < 2 and name != "raw":  # raw leaves the master stale: it is a lower bound only
                    check_loaded(engine, checkpoint, name)
                if name == "ours":
                    samples["verify"].timed(lambda: verify_master_weights(engine))
        load_after = os.getloadavg()

    print(f"model: {n_params / 1e6:.1f}M parameters, {options.layers} layers, hidden {options.hidden}, "
          f"vocab {options.vocab}; {options.precision}, ZeRO stage {options.zero_stage}; "
          f"checkpoint tag {files_mib:.1f} MiB; train step: batch {options.batch} x {options.seq} tokens")
    print(f"torch threads {torch.get_num_threads()}, {os.cpu_count()} CPUs; repeats {options.repeats}; "
          f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f}")
    if not malloc_returns_memory:
        print("glibc mallopt unavailable: freed memory may be reused unseen, peak RSS growth may read low")
    if samples["ours"].memory and not samples["ours"].memory[0].exact_peak:
        print("peak RSS from ru_maxrss (clear_refs refused): growth beyond the earlier peak only, a lower bound")
    print(table(["measured", "wall ms (median)", "cpu ms (median)", "peak RSS growth MiB", "RSS kept MiB"],
                [samples[name].row(name) for name in samples]))

    def wall(name: str) -> float:
        return median(samples[name].wall_s)

    def peak(name: str) -> float:
        return median([m.peak_growth_mib for m in samples[name].memory])

    print(ratio_line("ours/baseline wall", wall("ours"), wall("baseline"), "module-only load time"))
    print(ratio_line("ours/baseline cpu", median(samples["ours"].cpu_s), median(samples["baseline"].cpu_s),
                     "module-only load CPU time"))
    print(ratio_line("ours/baseline peak_rss", peak("ours"), peak("baseline"), "peak RSS growth during the load"))
    print(ratio_line("verify/train_step wall", wall("verify"), wall("train_step"),
                     "verify_master_weights against one forward+backward+step"))
    print(ratio_line("verify/ours wall", wall("verify"), wall("ours"), "share of our load spent verifying"))
    ratios = {"ours/baseline wall": wall("ours") / wall("baseline"),
              "ours/baseline peak_rss": peak("ours") / peak("baseline") if peak("baseline") else None,
              "verify/ours wall": wall("verify") / wall("ours")}
    if "raw" in samples:
        print(ratio_line("ours/raw wall", wall("ours"), wall("raw"),
                         "against torch.load(mmap) + load_state_dict, which leaves the master stale"))
        ratios["ours/raw wall"] = wall("ours") / wall("raw")
    if options.json:
        options.json.write_text(json.dumps({
            "options": {k: str(v) if isinstance(v, Path) else v for k, v in vars(options).items()},
            "parameters": n_params, "load_average": [load_before[0], load_after[0]], "ratios": ratios,
            "median_ms": {name: {"wall": 1e3 * median(s.wall_s), "cpu": 1e3 * median(s.cpu_s)}
                          for name, s in samples.items()},
        }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
