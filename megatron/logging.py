"""One rank-aware logger: rank 0 speaks, other ranks only report warnings and errors."""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from contextlib import contextmanager

from megatron.ranks import global_rank

LOGGER_NAME = "neox"


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return global_rank() == 0 or record.levelno >= logging.WARNING


def get_logger() -> logging.Logger:
    logger = logging.getLogger(LOGGER_NAME)
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler.addFilter(_RankFilter())
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger


class _Tee:
    """A stream that writes to the original stream and to a file."""

    def __init__(self, stream, path: str):
        self.stream = stream
        self.file = open(path, "a", buffering=1)  # noqa: SIM115 - open for the life of the process

    def write(self, text: str) -> int:
        self.file.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.file.flush()
        self.stream.flush()

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def tee_output_to(log_dir: str) -> None:
    """`log_dir`, as GPT-NeoX uses it: this process's stdout and stderr also go to
    <log_dir>/<hostname>_stdout.txt and <hostname>_stderr.txt (appended; every rank of a host)."""
    if isinstance(sys.stdout, _Tee):
        return
    os.makedirs(log_dir, exist_ok=True)
    prefix = os.path.join(log_dir, socket.gethostname())
    sys.stdout = _Tee(sys.stdout, prefix + "_stdout.txt")
    sys.stderr = _Tee(sys.stderr, prefix + "_stderr.txt")
    for handler in logging.getLogger(LOGGER_NAME).handlers:  # a logger made earlier still holds the old stream
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout.stream:
            handler.setStream(sys.stdout)


def quiet_deepspeed() -> None:
    """DeepSpeed logs every engine detail at INFO; keep its warnings, drop the chatter."""
    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(logging.WARNING)


SLOW_STAGE_SECONDS = 2.0


@contextmanager
def slow_stage(description: str):
    """A start-up step that can take long (a build on a first run): once it has run for 2 s, rank 0 says
    "<description> ...", and when it ends, what it took. A quick one (its result cached) prints nothing."""
    logger = get_logger()  # made here, outside the block: a block may redirect stdout
    announced = threading.Event()

    def announce() -> None:
        logger.info(f"{description} ...")
        announced.set()

    started = time.perf_counter()
    timer = threading.Timer(SLOW_STAGE_SECONDS, announce)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        timer.join()  # an announcement under way is finished before the done line
    if announced.is_set():
        logger.info(f"{description}: done in {time.perf_counter() - started:.1f} s")


def format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


def format_train_line(iteration: int, train_iters: int, scalars: dict, elapsed: float, left: float,
                      metric_names: tuple[str, ...] = ()) -> str:
    """The iteration line: the loss, then the objective's metrics (`train/<name>` in scalars), then the rest."""
    parts = [f"iteration {iteration:>{len(str(train_iters))}}/{train_iters}", f"loss {scalars['train/loss']:.4f}",
             *(f"{name} {scalars[f'train/{name}']:.4f}" for name in metric_names), f"lr {scalars['train/lr']:.3e}"]
    if scalars.get("train/grad_norm") is not None:
        parts.append(f"grad norm {scalars['train/grad_norm']:.3f}")
    if scalars.get("train/loss_scale") is not None:
        parts.append(f"loss scale {scalars['train/loss_scale']:g}")
    if scalars.get("train/skipped_steps") is not None:
        parts.append(f"skipped steps {scalars['train/skipped_steps']}")
    parts += [f"tokens/s {scalars['train/tokens_per_second']:,.0f}",
              f"step {scalars['train/step_seconds'] * 1e3:,.0f} ms", f"elapsed {format_duration(elapsed)}",
              f"left {format_duration(left)}"]
    return " | ".join(parts)


class ProgressReporter:
    """Rank 0's view of training: a line every ``log_interval`` steps, and a bar on a terminal.

    The line's tokens/s and step time are averages over the steps since the previous line (time
    spent in steps only, not in evaluation or saving): one step's rate swings too much to read.
    """

    def __init__(self, train_iters: int, log_interval: int, tokens_per_step: int, first_iteration: int,
                 metric_names: tuple[str, ...] = ()):
        """`tokens_per_step`: train_batch_size x seq_length."""
        self.train_iters = train_iters
        self.metric_names = metric_names
        self.log_interval = max(log_interval, 1)
        self.first_iteration = first_iteration
        self.tokens_per_step = tokens_per_step
        self.window_seconds = 0.0
        self.window_steps = 0
        self.started = time.perf_counter()
        self.logger = get_logger()
        self.bar = None
        if global_rank() == 0 and sys.stdout.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=train_iters, initial=first_iteration, dynamic_ncols=True, leave=False)

    def step(self, iteration: int, scalars: dict) -> dict | None:
        """Count one step (``scalars`` holds its ``train/step_seconds``); at a line, return the window's
        averages (``train/tokens_per_second``, ``train/step_seconds``), else None."""
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{scalars['train/loss']:.4f}", lr=f"{scalars['train/lr']:.2e}")
        self.window_seconds += scalars["train/step_seconds"]
        self.window_steps += 1
        if iteration % self.log_interval and iteration != self.train_iters:
            return None
        averages = {"train/tokens_per_second": self.tokens_per_step * self.window_steps / self.window_seconds,
                    "train/step_seconds": self.window_seconds / self.window_steps}
        self.window_seconds, self.window_steps = 0.0, 0
        elapsed = time.perf_counter() - self.started
        per_step = elapsed / max(iteration - self.first_iteration, 1)
        self.message(format_train_line(iteration, self.train_iters, {**scalars, **averages}, elapsed,
                                       per_step * (self.train_iters - iteration), self.metric_names))
        return averages

    def message(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line)
        else:
            self.logger.info(line)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class MetricsWriter:
    """TensorBoard scalars when ``tensorboard_dir`` is set, W&B when ``use_wandb`` is; rank 0 only."""

    def __init__(self, args):
        self.tensorboard = None
        self.wandb_run = None
        if global_rank() != 0:
            return
        if args.tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as error:
                raise RuntimeError(
                    f"tensorboard_dir is set ({args.tensorboard_dir}) but TensorBoard is not installed: "
                    "pip install tensorboard, or unset tensorboard_dir"
                ) from error
            self.tensorboard = SummaryWriter(log_dir=args.tensorboard_dir)
        if args.use_wandb:
            try:
                import wandb
            except ImportError:
                get_logger().warning("use_wandb is set but wandb is not installed; W&B logging is off")
            else:
                self.wandb_run = wandb.init(project=args.wandb_project, group=args.wandb_group,
                                            name=args.wandb_run_name, config=args.to_dict())

    def write(self, scalars: dict, step: int) -> None:
        present = {k: v for k, v in scalars.items() if v is not None}
        if self.tensorboard is not None:
            for key, value in present.items():
                self.tensorboard.add_scalar(key, value, step)
        if self.wandb_run is not None:
            self.wandb_run.log(present, step=step)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
