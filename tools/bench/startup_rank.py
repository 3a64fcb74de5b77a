"""The rank script bench_startup.py hands to deepy.py: train.py with the moments of its start-up written down.

Each phase of megatron.training.loop.setup is timed by wrapping the function that does it (the real one runs);
the first training step's end is the last moment. Written to $BENCH_STARTUP_DIR/rank<RANK>.json
(wall-clock seconds since the epoch, comparable across the processes of this machine). With
$BENCH_STARTUP_FLOOR set, the rank only imports torch and DeepSpeed and joins the gloo process group:
the floor every DeepSpeed run started through deepy.py pays.
"""

import time

STARTED = time.time()

import functools  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron.foreign_notices import hide_foreign_notices  # noqa: E402

hide_foreign_notices()  # before the imports below

# (module, attribute, phase): the functions setup() calls, looked up on their modules at call time
PHASES = (
    ("megatron.training.loop", "initialize_distributed", "process group"),
    ("megatron.tokenizer", "build_tokenizer", "tokenizer"),
    ("megatron.checkpointing", "plan_load_for", "load plan"),
    ("megatron.model", "build_model", "model"),
    ("deepspeed", "initialize", "engine"),
    ("megatron.checkpointing", "load_checkpoint", "load"),
    ("megatron.data.builders", "build_checked_datasets", "data"),
)


def write_moments(moments: dict) -> None:
    out = Path(os.environ["BENCH_STARTUP_DIR"]) / f"rank{os.environ.get('RANK', '0')}.json"
    out.write_text(json.dumps(moments))


def floor() -> int:
    import deepspeed
    import torch.distributed as dist

    imported = time.time()
    deepspeed.init_distributed(dist_backend="gloo")
    dist.barrier()
    joined = time.time()
    write_moments({"started": STARTED, "imported": imported, "phases": [["process group", imported, joined]],
                   "first_step": joined})
    return 0


def train() -> None:
    import importlib

    from megatron.runtime.stop_signals import StopSignals

    stop_signals = StopSignals()
    stop_signals.install()
    from megatron.runtime.cpu_info import ask_cpu_info_early

    ask_cpu_info_early()
    import deepspeed  # noqa: F401  (setup imports it; here it counts as an import)

    from megatron.neox_arguments import load_args_on_rank
    from megatron.runtime.rank_errors import exit_after_rank
    from megatron.training import loop as training

    moments = {"started": STARTED, "imported": time.time(), "phases": []}

    def timed(phase, call):
        @functools.wraps(call)
        def wrapper(*args, **kwargs):
            start = time.time()
            try:
                return call(*args, **kwargs)
            finally:
                moments["phases"].append([phase, start, time.time()])
        return wrapper

    for module, attribute, phase in PHASES:
        owner = importlib.import_module(module)
        setattr(owner, attribute, timed(phase, getattr(owner, attribute)))
    train_step = training.train_step

    def first_step(*args, **kwargs):
        start = time.time()
        result = train_step(*args, **kwargs)
        moments["phases"].append(["first step", start, time.time()])
        moments["first_step"] = time.time()
        write_moments(moments)
        training.train_step = train_step
        return result

    training.train_step = first_step
    exit_after_rank(lambda: training.pretrain(load_args_on_rank(), stop_signals))  # as train.py ends


if __name__ == "__main__":
    if os.environ.get("BENCH_STARTUP_FLOOR"):
        sys.exit(floor())
    train()
