"""Mistakes a user makes, run through deepy.py as the user would: each gives one line saying what is
wrong and where, no traceback, and never DeepSpeed's launcher line with the settings blob."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from deepspeed.accelerator import get_accelerator

from megatron.checkpointing import CheckpointError
from megatron.checkpointing.ondisk.safe_unpickle import load_weights_only
from megatron.contract.architecture import ModelConfigError
from megatron.data.errors import DataError
from megatron.data.indexed_dataset import data_file_path
from megatron.hf.errors import HFConversionError
from megatron.launch.launcher import port_is_free, rendezvous_port
from megatron.neox_arguments import ConfigError, NeoXArgs
from megatron.runtime.rank_errors import EXIT_EXPECTED_ERROR, expected_error_line, run_rank
from megatron.tokenizer.errors import TokenizerError
from tests.deepy_runs import run_deepy, train_lines, write_overrides
from tests.unit.test_data_vocabulary import MODEL, write_dataset
from tests.unit.test_launcher import launch_args

pytestmark = pytest.mark.e2e


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if "error" in line.lower() and "WARNING" not in line]


def assert_one_line(result, *fragments: str) -> str:
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "Traceback" not in output and "--neox_args=eNq" not in output, output[-4000:]
    lines = error_lines(output)
    assert len(lines) == 1, output[-4000:]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize(
    ("settings", "fragments"),
    [
        ({"split": "0, 50, 50"}, ["overrides.yml: split", "training split no documents"]),
        ({"split": "90, ten"}, ["overrides.yml: split", "comma-separated numbers"]),
        ({"seed": -1}, ["overrides.yml: seed", "must be between 0 and"]),
        pytest.param({"precision": "fp16"}, ["overrides.yml: precision", "fp16 is not supported by DeepSpeed on a CPU"],
                     marks=pytest.mark.skipif(get_accelerator().is_fp16_supported(),
                                              reason="this CPU runs fp16 (oneDNN), so DeepSpeed accepts it")),
        ({"optimizer": {"type": "Adam", "params": {"lr": "5e-3", "eps": "abc"}}},
         ["overrides.yml: optimizer.params.eps", "'abc' is not a number"]),
        ({"optimizer": {"type": "Adam", "params": {"lr": "5e-3", "betas": [1.5, 0.95]}}},
         ["overrides.yml: optimizer.params.betas", "must each be in [0, 1), got [1.5, 0.95]"]),
        ({"optimizer": {"type": "Adam", "params": {"lr": "5e-3", "freeze_step": 400}}},
         ["overrides.yml: optimizer.params.freeze_step", "not a parameter of FusedAdam", "remove it"]),
        ({"zero_optimization": {"stage": 2, "reduce_bucket_size": "5.5e0"}},
         ["overrides.yml: zero_optimization.reduce_bucket_size", "'5.5e0' is not a whole number"]),
        ({"weight_decay": "1e-2", "optimizer": {"type": "Adam", "params": {"lr": "5e-3", "weight_decay": 0.02}}},
         ["overrides.yml: weight_decay (0.01) and", "optimizer.params.weight_decay (0.02) disagree"]),
    ],
)
@pytest.mark.slow
def test_settings_mistakes_are_one_line_before_anything_starts(tmp_path, settings, fragments):
    result = run_deepy(["configs/tiny.yml", write_overrides(tmp_path, **settings)], expect_success=False)
    assert result.returncode == 2
    assert_one_line(result, "deepy.py: config error", *fragments)


def test_a_key_written_twice_in_one_file_is_an_error_naming_file_and_key(tmp_path):
    config = write_overrides(tmp_path, train_iters=10)
    config.write_text(config.read_text() + "train_iters: 20\n")
    result = run_deepy(["configs/tiny.yml", config], expect_success=False)
    assert_one_line(result, f"{config}: key 'train_iters' is set twice")


def test_a_master_port_in_use_is_an_error_naming_the_port(tmp_path):
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_deepy(["configs/tiny.yml", write_overrides(tmp_path, master_port=port)], expect_success=False)
    assert_one_line(result, "master_port", f"port {port} is already in use")


def test_without_master_port_a_single_node_run_gets_a_free_port_not_29500():
    args = launch_args()
    assert not args.set_by_user("master_port") and args.master_port == 29500
    with socket.socket() as taken:  # another run holding GPT-NeoX's default port
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            taken.bind(("", 29500))
            taken.listen()
        except OSError:
            pass  # held by someone else already: the same situation
        port = rendezvous_port(args)
        assert port != 29500 and port_is_free(port)


def test_a_user_master_port_is_kept_when_free():
    port = rendezvous_port(launch_args(master_port=29611))
    assert port == 29611 or not port_is_free(29611)


@pytest.mark.distributed
@pytest.mark.slow
def test_a_load_that_is_a_file_is_one_line_from_rank_zero_of_two(tmp_path):
    not_a_directory = tmp_path / "model.pt"
    not_a_directory.write_bytes(b"weights?")
    config = write_overrides(tmp_path, load=str(not_a_directory), num_gpus=2, train_iters=5)
    result = run_deepy(["configs/tiny.yml", config], expect_success=False)
    assert result.returncode == EXIT_EXPECTED_ERROR
    line = assert_one_line(result, f"{not_a_directory} is a file, not a checkpoint directory")
    assert line.startswith("error: ")


def test_out_of_memory_is_one_line_with_a_hint(capsys):
    assert run_rank(lambda: torch.empty(2**60, dtype=torch.uint8)) == EXIT_EXPECTED_ERROR
    line, = capsys.readouterr().err.splitlines()
    assert line.startswith("error: out of memory") and "train_micro_batch_size_per_gpu" in line


def test_a_bug_keeps_its_traceback():
    def buggy():
        return {}["missing"]

    assert expected_error_line(KeyError("missing")) is None
    with pytest.raises(KeyError):
        run_rank(buggy)


@pytest.mark.parametrize(
    "error_class", [ConfigError, CheckpointError, DataError, ModelConfigError, TokenizerError, HFConversionError])
def test_every_area_error_is_reported_as_one_line(error_class):
    assert expected_error_line(error_class("what is wrong\nwhat to do")) == "what is wrong what to do"


# --- numbers written the GPT-NeoX way, empty and stale data ------------------------------------

GPT_NEOX_NUMBERS = """optimizer: {type: AdamW, params: {lr: 5e-3, betas: [9e-1, 0.95], eps: 1e-8, weight_decay: 1e-2}}
weight_decay: 1e-2
min_lr: 0
lr_decay_style: constant
zero_optimization: {stage: 1, reduce_bucket_size: 5e8, allgather_bucket_size: 5e8}
"""


@pytest.mark.slow
def test_a_run_trains_with_numbers_pyyaml_reads_as_strings(tmp_path):
    """`lr: 5e-3` and `eps: 1e-8` are strings to PyYAML: the run trains at those values (a real 1-rank run)."""
    save = tmp_path / "ckpt"
    config = write_overrides(tmp_path, save=str(save), train_iters=3, checkpoint_factor=3, eval_interval=3)
    config.write_text(config.read_text() + GPT_NEOX_NUMBERS)
    result = run_deepy(["configs/tiny.yml", config])
    assert [line.lr for line in train_lines(result.stdout)] == [5e-3] * 3
    optimizer_file, = (save / "global_step3").glob("*optim_states.pt")
    # the optimizer DeepSpeed built, as it saved it
    state = load_weights_only(optimizer_file)["optimizer_state_dict"]
    group = state["base_optimizer_state"]["param_groups"][0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (5e-3, [0.9, 0.95], 1e-8, 0.01)


def _no_documents(prefix, _vocab_size):
    write_dataset(prefix, [])
    return "holds no tokens (0 documents in"


def _same_sized_data_of_a_larger_vocabulary(prefix, vocab_size):
    """A .meta.json left by other data of the same size and tokenizer: it says the ids stay below 140, the .bin
    holds 973."""
    write_dataset(prefix, [list(range(140))] * 8, vocab_size=vocab_size)
    write_dataset(prefix, [list(range(0, 1000, 7))[:140]] * 8)
    later = os.stat(data_file_path(prefix)).st_mtime_ns + 10**9  # rewritten later than in the same clock tick
    os.utime(data_file_path(prefix), ns=(later, later))
    return "holds token id 385 (document 0, position 55), but the model has"


@pytest.mark.parametrize(
    "make_data",
    [
        _no_documents,
        _same_sized_data_of_a_larger_vocabulary,
    ],
    ids=["empty dataset", "stale meta.json"],
)
@pytest.mark.slow
def test_bad_data_stops_the_run_before_the_first_step_with_one_line(tmp_path, make_data):
    """Without these checks: an empty train split, or ids past the embedding, end in a traceback at step 1."""
    from megatron.tokenizer import build_tokenizer, train_bpe_tokenizer

    vocab_file = train_bpe_tokenizer(["def f(x):\n    return x * x\n"] * 50, tmp_path / "tok.json", vocab_size=300)
    tokenizer = {"tokenizer_type": "HFTokenizer", "vocab_file": str(vocab_file)}
    prefix = tmp_path / "data_text_document"
    expected = make_data(prefix, build_tokenizer(NeoXArgs.from_dict({**MODEL, **tokenizer})).vocab_size)
    config = write_overrides(tmp_path, data_path=str(prefix), train_iters=3, eval_interval=3, **tokenizer)
    result = run_deepy(["configs/tiny.yml", config], expect_success=False)
    assert result.returncode == EXIT_EXPECTED_ERROR
    line = assert_one_line(result, f"data_path: dataset {prefix} ", expected)
    assert line.startswith("error: ") and " | loss " not in result.stdout


def test_a_rank_that_finished_leaves_its_process_group_and_one_that_failed_does_not():
    """Left to the interpreter's teardown, gloo's threads can abort a finished run (exit -6, 'terminate called
    without an active exception'); a failed rank keeps its group, whose pending work could wait on its peers."""
    script = (
        "import torch.distributed as dist\n"
        "from megatron.launch.launcher import free_port\n"
        "from megatron.neox_arguments import ConfigError\n"
        "from megatron.runtime.rank_errors import run_rank\n"
        "dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{free_port()}', rank=0, world_size=1)\n"
        "def fail():\n"
        "    raise ConfigError('a setting is wrong')\n"
        "print('after a failure:', run_rank(fail), dist.is_initialized())\n"
        "print('after success:', run_rank(lambda: dist.barrier()), dist.is_initialized())\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[-2:] == [f"after a failure: {EXIT_EXPECTED_ERROR} True", "after success: 0 False"]
