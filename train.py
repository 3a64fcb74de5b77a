"""Entry point of every rank, started by deepy.py through the DeepSpeed launcher."""

from megatron.foreign_notices import hide_foreign_notices
from megatron.logging import slow_stage
from megatron.runtime.stop_signals import StopSignals

if __name__ == "__main__":
    # first thing: a SIGTERM during the imports below must not kill the rank before it can save
    stop_signals = StopSignals()
    stop_signals.install()
    # answered while the rank imports, before DeepSpeed's optimizer op needs it (megatron/runtime/cpu_info.py)
    from megatron.runtime.cpu_info import ask_cpu_info_early

    ask_cpu_info_early()

hide_foreign_notices()  # before the imports below

with slow_stage("starting the rank (importing torch, DeepSpeed and megatron-core)"):
    from megatron.neox_arguments import load_args_on_rank
    from megatron.runtime.rank_errors import exit_after_rank
    from megatron.training.loop import pretrain

if __name__ == "__main__":
    exit_after_rank(lambda: pretrain(load_args_on_rank(), stop_signals))
