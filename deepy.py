#!/usr/bin/env python
"""Validate GPT-NeoX style YAML configs, then start every rank of this machine (or DeepSpeed's runner).

    python deepy.py TRAIN_SCRIPT CONFIG [CONFIG ...] [--dry-run] [--verbose] [--eval_tasks TASK ...] [--iteration N]

Config paths are taken as given, else under configs/. Later files override earlier ones key by
key (a nested dict such as zero_optimization is replaced as a whole, as in GPT-NeoX). --dry-run
prints the resolved settings and the DeepSpeed config and starts nothing. --verbose also shows the
notices of DeepSpeed, torch and megatron-core that report nothing wrong (megatron/foreign_notices.py),
here and in every rank. Every rank receives the validated settings in one argv flag and reads them with
megatron.neox_arguments.load_args_on_rank(). GPT-NeoX's --eval_tasks, --eval_results_prefix and
--iteration set those settings over every file.

The ranks run in a process group of their own: a SIGTERM or SIGINT (Ctrl-C) to deepy.py, to a rank or
to all of them is passed on to the ranks, which finish their step, save a checkpoint and exit 0; a
second one stops them at once. One before any rank exists ends deepy.py with one line and exit 0. No
process of the run outlives deepy.py (megatron/launch/supervision.py).
"""

from __future__ import annotations

from megatron.launch.supervision import Supervisor, exit_if_stopped_before_launch, stop_quietly_before_launch

if __name__ == "__main__":
    stop_quietly_before_launch()  # first thing: a SIGTERM while the imports below run ends with one line too

import argparse  # noqa: E402
import contextlib
import logging
import os
import sys
from pathlib import Path

from megatron.errors import ExpectedError
from megatron.foreign_notices import VERBOSE_VARIABLE, hide_foreign_notices
from megatron.launch.launcher import (
    RankCommand,
    launcher_environment,
    local_rank_commands,
    rendezvous_port,
    runner_command,
    starts_only_local_ranks,
)
from megatron.launch.run_context import check_run_files, resolve_run_settings, settings_for_run
from megatron.neox_arguments import ConfigError
from megatron.neox_arguments.dry_run import render_dry_run, tokenizer_summary
from megatron.neox_arguments.handover import HANDOVER_FLAG, handover_argv
from megatron.neox_arguments.world import accelerator_is_cpu, check_precision_on_cpu
from megatron.neox_arguments.yaml_files import gpt_neox_config_paths
from megatron.processes import skip_collection_at_exit
from megatron.tokenizer import TokenizerError


def parse_command_line(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("train_script", help="the script every rank runs, e.g. train.py")
    parser.add_argument("configs", nargs="+", help="YAML config files; later ones override earlier ones")
    parser.add_argument("-d", "--conf_dir", help="directory put in front of every config path (as in GPT-NeoX)")
    parser.add_argument("--dry-run", action="store_true", help="print the resolved settings and exit")
    parser.add_argument("--verbose", action="store_true",
                        help=f"show the notices of DeepSpeed, torch and megatron-core that are hidden because they "
                             f"report nothing wrong, here and in every rank (sets {VERBOSE_VARIABLE}=1)")
    # GPT-NeoX's evaluation flags; each overrides the setting of its name in the config files
    evaluation = parser.add_argument_group("eval.py and generate.py")
    evaluation.add_argument("--eval_tasks", nargs="+", help="the harness's tasks eval.py runs")
    evaluation.add_argument("--eval_results_prefix", help="eval.py's results file: <prefix>_eval_results_<date>.json")
    evaluation.add_argument("--iteration", type=int, help="load tag global_step<iteration> instead of the latest")
    return parser.parse_args(argv)


COMMAND_LINE_SETTINGS = ("eval_tasks", "eval_results_prefix", "iteration")


def command_line_settings(command_line: argparse.Namespace) -> dict:
    return {name: getattr(command_line, name) for name in COMMAND_LINE_SETTINGS
            if getattr(command_line, name) is not None}


def send_deepspeed_logs_to_stderr() -> None:
    """DeepSpeed logs to stdout (already while importing); keep stdout for the --dry-run report."""
    with contextlib.redirect_stdout(sys.__stderr__):
        from deepspeed.utils import logger

    for handler in logger.handlers:  # only DeepSpeed's own stdout handler; others (pytest's capture) stay
        if isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stdout, sys.__stdout__):
            handler.setStream(sys.__stderr__)


def main(argv: list[str] | None = None) -> int:
    command_line = parse_command_line(argv)
    if command_line.verbose:
        os.environ[VERBOSE_VARIABLE] = "1"  # the ranks inherit it
    hide_foreign_notices()
    send_deepspeed_logs_to_stderr()
    try:
        args = settings_for_run(gpt_neox_config_paths(command_line.configs, command_line.conf_dir),
                                command_line_settings(command_line))
        for notice in args.notices:
            print(notice, file=sys.stderr)
        # what the start would refuse, --dry-run refuses too
        if not Path(command_line.train_script).is_file():
            raise ConfigError(f"train script {command_line.train_script!r} not found")
        check_precision_on_cpu(args)
        if command_line.dry_run:
            if not starts_only_local_ranks(args):  # what DeepSpeed's runner would refuse of the launcher settings
                runner_command(args, command_line.train_script, [], cpu_only=accelerator_is_cpu())
            report = render_dry_run(args, tokenizer_summary(args))
            check_run_files(args)  # the data files, as the start checks them
            exit_if_stopped_before_launch()
            sys.stdout.write(report)
            return 0
        args = resolve_run_settings(args)  # builds the tokenizer: a file it cannot read stops here
        cpu_only = accelerator_is_cpu()
        port = rendezvous_port(args)
        if port != args.master_port:
            args = args.with_values({"master_port": port}, source="deepy.py (a free port on this machine)")
        environment = launcher_environment(dict(os.environ), cpu_only=cpu_only)
        ranks_here = starts_only_local_ranks(args)
        if ranks_here:
            processes = local_rank_commands(args, command_line.train_script, handover_argv(args), environment)
        else:
            command = runner_command(args, command_line.train_script, handover_argv(args), cpu_only=cpu_only)
            processes = [RankCommand(command, environment)]
    except (ConfigError, TokenizerError) as err:
        print(f"deepy.py: config error: {err}", file=sys.stderr)
        return 2
    except ExpectedError as err:  # a data file or checkpoint the dry run checks as the start does
        print(f"deepy.py: error: {err}", file=sys.stderr)
        return 2
    exit_if_stopped_before_launch()
    print(f"deepy.py: {launch_line(processes, ranks_here)}", file=sys.stderr, flush=True)
    return Supervisor(processes, ranks_here=ranks_here).run()


def launch_line(processes: list[RankCommand], ranks_here: bool) -> str:
    """What deepy.py starts, in one line: the ranks' command (the settings shortened) and world, or the runner's."""
    shown = [part if not part.startswith(HANDOVER_FLAG) else f"{HANDOVER_FLAG}=<settings>" for part in processes[0].argv]
    if not ranks_here:
        return " ".join(shown)
    env = processes[0].env
    ranks = env["RANK"] if len(processes) == 1 else f"{env['RANK']}-{processes[-1].env['RANK']}"
    local_rank = shown.index("--local_rank=0")
    shown[local_rank] = "--local_rank=<0>" if len(processes) == 1 else f"--local_rank=<0-{len(processes) - 1}>"
    return (f"ranks {ranks} of {env['WORLD_SIZE']} on this machine (MASTER_ADDR={env['MASTER_ADDR']} "
            f"MASTER_PORT={env['MASTER_PORT']}): {' '.join(shown)}")


if __name__ == "__main__":
    status = main()
    skip_collection_at_exit()
    sys.exit(status)
