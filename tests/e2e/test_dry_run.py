"""deepy.py as a user runs it: --dry-run on every shipped config, bad configs, a real 2-rank launch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

import deepy
from megatron.launch.run_context import resolve_run_settings
from megatron.neox_arguments import SETTINGS, NeoXArgs
from megatron.tokenizer import train_bpe_tokenizer
from tests.conftest import free_port
from tests.rank_echo import settings_digest
from tests.unit.test_data_gpt_dataset import write_documents
from tests.unit.test_neox_args import TINY_RUN, write_yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIGS = REPO_ROOT / "configs"
OVERLAYS = ("local_setup.yml", "finetune.yml", "text_generation.yml")  # meant to be added on top of a model config
MODEL_CONFIGS = sorted(p for p in CONFIGS.rglob("*.yml") if p.name not in OVERLAYS)
OVERLAY_CONFIGS = sorted(p for p in CONFIGS.rglob("*.yml") if p.name in OVERLAYS)
RANK_ECHO = str(REPO_ROOT / "tests" / "rank_echo.py")
DATA_DOCUMENTS, DATA_DOCUMENT_LENGTH = 200, 2100  # a split of one document holds a packed sample of 2048


def write_data_named_by(configs: list[Path], root: Path) -> None:
    """Small datasets at every data path `configs` name, relative paths under `root` (the directory the dry run
    starts in): the dry run opens them, as the start does. Every token and label file holds the same documents
    (each usable: as long as a sample where the settings do not chop documents),
    every reward file one reward per document, every precomputed file seq_length log-probabilities a document."""
    args = NeoXArgs.from_yaml_files(configs)
    # unpacked without allow_chopped, a document longer than a sample is one no sample can hold
    length = args.seq_length + 1 if args.pack_impl == "unpacked" and not args.allow_chopped else DATA_DOCUMENT_LENGTH
    tokens = [np.arange(1, length + 1) % 200 + 1] * DATA_DOCUMENTS
    for name in [name for name in SETTINGS if name == "data_path" or name.endswith("_data_paths")]:
        value = getattr(args, name)
        for prefix in [value] if isinstance(value, str) else value or []:
            (root / prefix).parent.mkdir(parents=True, exist_ok=True)
            if "reward" in name:
                write_documents(root / prefix, [np.ones(1, np.float32)] * DATA_DOCUMENTS, np.float32)
                continue
            write_documents(root / prefix, tokens, np.int32)
            if args.precompute_model_name and "label" not in name:
                write_documents(root / f"{prefix}_{args.precompute_model_name}",
                                [np.zeros(args.seq_length, np.float32)] * DATA_DOCUMENTS, np.float32)


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory) -> Path:
    texts = ["a user's own tokenizer, trained here", "for the dry runs of the shipped configs"] * 10
    return train_bpe_tokenizer(texts, tmp_path_factory.mktemp("tokenizer") / "tokenizer.json", vocab_size=270)


def dry_run(configs: list[Path], capsys) -> dict:
    assert deepy.main([RANK_ECHO, *map(str, configs), "--dry-run"]) == 0
    report = yaml.safe_load(capsys.readouterr().out)
    args = NeoXArgs.from_yaml_files(configs)
    expected = args.to_dict()
    expected["config_files"] = sorted(expected["config_files"])
    assert report["settings"] == expected
    if args.requires_run_settings:
        assert report["deepspeed_config"] == args.deepspeed_config()
    return report, args


def run_deepy(*argv: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "deepy.py", *argv], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_real_size_configs_are_shipped():
    names = {p.relative_to(CONFIGS).as_posix() for p in MODEL_CONFIGS}
    assert {"pythia/160M.yml", "llama/tiny-llama-1.1B.yml"} <= names


@pytest.mark.parametrize("config", MODEL_CONFIGS, ids=lambda p: p.relative_to(CONFIGS).as_posix())
def test_dry_run_of_every_model_config(config, tmp_path, tokenizer_json, capsys, fp16_capable_cpu, monkeypatch):
    """Each shipped config is understood; the fp16 ones (Pythia's) as on a GPU, whatever this CPU supports."""
    configs = [config]
    if not NeoXArgs.from_yaml_files(configs).embedded_corpus:  # the config asks the user for a tokenizer file
        configs.append(write_yaml(tmp_path, "my_tokenizer.yml", {"vocab_file": str(tokenizer_json)}))
    monkeypatch.chdir(tmp_path)  # the user's data, where the config's relative paths point
    write_data_named_by(configs, tmp_path)
    dry_run(configs, capsys)


def test_dry_run_loads_the_tokenizer_and_says_what_it_is(tmp_path, tokenizer_json, capsys, monkeypatch):
    config = write_yaml(tmp_path, "own_data.yml", {**TINY_RUN, "embedded_corpus": False, "data_path": "data/x_text_document",
                                                   "tokenizer_type": "HFTokenizer", "vocab_file": str(tokenizer_json),
                                                   "make_vocab_size_divisible_by": 128})
    monkeypatch.chdir(tmp_path)
    write_data_named_by([config], tmp_path)
    dry_run([config], capsys)
    assert deepy.main([RANK_ECHO, str(config), "--dry-run"]) == 0
    first_line = capsys.readouterr().out.splitlines()[0]
    assert first_line == "# tokenizer: HFTokenizer, 270 tokens (padded to 384), end of document id 0"


def test_dry_run_fails_on_a_tokenizer_that_cannot_be_loaded(tmp_path, tokenizer_json):
    """GPT-NeoX's default tokenizer_type (GPT2BPETokenizer) with a merges file that is not there."""
    vocab = tmp_path / "vocab.json"
    vocab.write_text('{"<|endoftext|>": 0, "a": 1}')
    config = write_yaml(tmp_path, "gpt2.yml", {**TINY_RUN, "embedded_corpus": False, "data_path": "data/x_text_document",
                                               "vocab_file": str(vocab), "merge_file": str(tmp_path / "merges.txt")})
    result = run_deepy(RANK_ECHO, str(config), "--dry-run")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines()[-1] == (
        f"deepy.py: config error: merge_file {str(tmp_path / 'merges.txt')!r} (for tokenizer_type GPT2BPETokenizer) "
        "does not exist or is not a file; set merge_file to GPT-2's merges.txt")
    result = run_deepy(RANK_ECHO, str(config))  # a launch stops there too, before any rank starts
    assert result.returncode == 2 and "RANK_ECHO" not in result.stdout and "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("deepy.py: config error: ") and "merges.txt' (for tokenizer_type GPT2BPETokenizer)" in last


@pytest.mark.parametrize("overlay", OVERLAY_CONFIGS, ids=lambda p: p.name)
def test_dry_run_of_overlays_on_the_tiny_config(overlay, capsys):
    tiny = CONFIGS / "tiny.yml"
    if not tiny.is_file():
        pytest.skip("configs/tiny.yml is not there yet")
    report, args = dry_run([tiny, overlay], capsys)
    overlay_keys = {key.replace("-", "_") for key in (yaml.safe_load(overlay.read_text()) or {})} & set(SETTINGS)
    assert overlay_keys
    for key in overlay_keys:
        assert args.source_of(key) == str(overlay)
    assert report["settings"]["config_files"] == sorted({"tiny.yml", overlay.name})


def test_dry_run_marks_sources_and_defaults(tmp_path, capsys):
    base = write_yaml(tmp_path, "base.yml", TINY_RUN)
    overlay = write_yaml(tmp_path, "overlay.yml", {"seq-length": 64})
    assert deepy.main([RANK_ECHO, str(base), str(overlay), "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert f"  seq_length: 64  # {overlay}" in lines
    assert f"  hidden_size: 64  # {base}" in lines
    assert "  seed: 1234  # default" in lines
    assert "  zero_stage: 0  # derived" in lines


def test_bad_config_exits_nonzero_with_the_error_and_starts_nothing(tmp_path):
    bad = write_yaml(tmp_path, "bad.yml", {**TINY_RUN, "num_gpus": 2, "hidden_sise": 64})
    result = run_deepy(RANK_ECHO, str(bad))
    assert result.returncode != 0
    assert "bad.yml: hidden_sise: unknown setting; did you mean 'hidden_size'?" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert "RANK_ECHO" not in result.stdout


def test_inert_settings_print_one_notice_line_each(tmp_path):
    config = write_yaml(tmp_path, "fused.yml", {**TINY_RUN, "bias_dropout_fusion": True, "rope_fusion": True})
    result = run_deepy(RANK_ECHO, str(config), "--dry-run")
    assert result.returncode == 0, result.stderr
    notices = [line for line in result.stderr.splitlines() if line.startswith("notice:")]
    assert len(notices) == 2 and "bias_dropout_fusion" in notices[0] and "rope_fusion" in notices[1]


@pytest.mark.distributed
@pytest.mark.slow
def test_launch_two_cpu_ranks_that_receive_identical_settings(tmp_path):
    config = write_yaml(tmp_path, "two_ranks.yml", {**TINY_RUN, "num_gpus": 2, "master_port": free_port()})
    result = run_deepy(RANK_ECHO, str(config), timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    echoes = [line.split("RANK_ECHO ", 1)[1] for line in result.stdout.splitlines() if "RANK_ECHO " in line]
    fields = [dict(part.split("=", 1) for part in echo.split()) for echo in echoes]
    assert sorted(f["rank"] for f in fields) == ["0", "1"]
    assert {f["world"] for f in fields} == {"2"} and {f["global_num_gpus"] for f in fields} == {"2"}
    expected = settings_digest(resolve_run_settings(NeoXArgs.from_yaml_files([config])).to_dict())
    assert {f["settings"] for f in fields} == {expected}


GPT_NEOX_FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "gpt_neox"


def test_gpt_neox_style_configs_with_conf_dir_as_gpt_neox_users_type_them():
    result = run_deepy(RANK_ECHO, "-d", str(GPT_NEOX_FIXTURES), "small/model", "small/train_config.yml",
                       "small/local_setup.yml", "--dry-run")
    assert result.returncode == 0, result.stderr
    report = yaml.safe_load(result.stdout.split("\n", 1)[1])  # below the tokenizer line
    settings = report["settings"]
    assert settings["config_files"] == ["local_setup.yml", "model.yml", "train_config.yml"]
    assert settings["sliding_window_width"] == 8 and settings["extra_save_iters"] == [0, 1, 2, 4]
    assert settings["global_num_gpus"] == 1 and settings["hostfile"] is None
    assert report["deepspeed_config"]["communication_data_type"] == "fp32"  # fp32_allreduce
    notices = [line for line in result.stderr.splitlines() if line.startswith("notice:")]
    assert any("/nonexistent/gpt-neox/hostfile' does not exist; running on this machine only" in n for n in notices)
    assert any("layernorm_fusion has no effect here" in n for n in notices)
    assert all("\n" not in n for n in notices)


def test_dry_run_reads_numbers_pyyaml_leaves_as_strings_as_the_numbers_they_are(tmp_path):
    """GPT-NeoX configs write `lr: 6e-4`, `eps: 1e-8`, `reduce_bucket_size: 5e8`, strings to PyYAML (YAML 1.1)."""
    model = yaml.safe_dump({key: value for key, value in TINY_RUN.items() if key != "optimizer"}, sort_keys=False)
    as_written = write_yaml(tmp_path, "neox_style.yml", model + """
optimizer: {type: Adam, params: {lr: 6e-4, betas: [0.9, 0.95], eps: 1e-8}}
weight_decay: 1e-2
zero_optimization: {stage: 1, reduce_bucket_size: 5e8, allgather_bucket_size: 5e8}
""")
    as_floats = write_yaml(tmp_path, "floats.yml", model + """
optimizer: {type: Adam, params: {lr: 0.0006, betas: [0.9, 0.95], eps: 1.0e-8}}
weight_decay: 0.01
zero_optimization: {stage: 1, reduce_bucket_size: 500000000, allgather_bucket_size: 500000000}
""")
    reports = []
    for config in (as_written, as_floats):
        result = run_deepy(RANK_ECHO, str(config), "--dry-run")
        assert result.returncode == 0, result.stderr
        reports.append(yaml.safe_load(result.stdout)["deepspeed_config"])
    assert reports[0] == reports[1]
    assert reports[0]["optimizer"]["params"] == {"lr": 6e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01}
    assert reports[0]["zero_optimization"]["reduce_bucket_size"] == 500000000


def test_dry_run_refuses_fp16_on_a_cpu_without_it_as_the_start_does(tmp_path, monkeypatch, capsys):
    """On a machine whose CPU accelerator has no fp16 (DeepSpeed refuses it in every rank), --dry-run says so."""
    from deepspeed.accelerator import get_accelerator

    monkeypatch.setattr(get_accelerator(), "is_fp16_supported", lambda: False)
    config = write_yaml(tmp_path, "half.yml", {**TINY_RUN, "fp16": {"enabled": True}})
    assert deepy.main([RANK_ECHO, str(config), "--dry-run"]) == 2
    assert "half.yml: fp16: fp16 is not supported by DeepSpeed on a CPU" in capsys.readouterr().err


def test_dry_run_refuses_a_train_script_that_is_not_there(tmp_path, capsys):
    config = write_yaml(tmp_path, "run.yml", TINY_RUN)
    assert deepy.main(["no_such_script.py", str(config), "--dry-run"]) == 2
    assert "train script 'no_such_script.py' not found" in capsys.readouterr().err


def test_gpt_neox_125m_dmoe_recipe_passes_the_dry_run_at_its_rank_count(tmp_path, tokenizer_json, capsys, monkeypatch):
    """GPT-NeoX's configs/125M-dmoe.yml, unchanged: 8 experts in every layer behind GPT-NeoX's default router
    (sinkhorn), bf16, ZeRO-0, at its 4 ranks: 2 pipeline stages x 2 tensor-parallel ranks, each holding 4 of
    every layer's experts. The DeepSpeed config sends the router statistics between stages whole (partitioned
    sends cannot carry a second tensor that needs a gradient). The user's overlay gives the tokenizer and data,
    as GPT-NeoX's local_setup.yml does."""
    recipe = REPO_ROOT / "tests" / "fixtures" / "gpt_neox" / "configs" / "125M-dmoe.yml"
    local = write_yaml(tmp_path, "local.yml", {"vocab_file": str(tokenizer_json), "tokenizer_type": "HFTokenizer",
                                               "data_path": "data/enwik8_text_document", "num_gpus": 4})
    monkeypatch.chdir(tmp_path)
    write_data_named_by([recipe, local], tmp_path)
    report, args = dry_run([recipe, local], capsys)
    assert (args.global_num_gpus, args.pipe_parallel_size, args.model_parallel_size, args.data_parallel_size) == (
        4, 2, 2, 1)
    assert (args.precision, args.zero_stage) == ("bf16", 0)
    assert (args.moe_num_experts, args.moe_router_type, args.moe_top_k, args.moe_expert_interval) == (8, "sinkhorn", 1, 1)
    assert report["deepspeed_config"]["pipeline"] == {"pipe_partitioned": False, "grad_partitioned": False}
    assert report["deepspeed_config"]["train_batch_size"] == 4


def test_gpt_neox_20b_recipe_passes_the_dry_run_at_its_rank_count(tmp_path, tokenizer_json, capsys, fp16_capable_cpu,
                                                                  monkeypatch):
    """GPT-NeoX's own configs/20B.yml, unchanged, on its 96 ranks (a hostfile of 12 nodes x 8): 4 pipeline stages
    x 2 tensor-parallel x 12 data-parallel ranks, ZeRO-1, fp16. Only the tokenizer file is the user's, and fp16
    is allowed as on the GPU machines the recipe is for (this CPU's DeepSpeed accelerator has none)."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"node{i} slots=8\n" for i in range(12)))
    recipe = REPO_ROOT / "tests" / "fixtures" / "gpt_neox" / "configs" / "20B.yml"
    cluster = write_yaml(tmp_path, "cluster.yml", {"vocab_file": str(tokenizer_json), "hostfile": str(hostfile)})
    monkeypatch.chdir(tmp_path)
    write_data_named_by([recipe, cluster], tmp_path)
    report, args = dry_run([recipe, cluster], capsys)
    assert (args.global_num_gpus, args.pipe_parallel_size, args.model_parallel_size, args.data_parallel_size) == (
        96, 4, 2, 12)
    assert (args.zero_stage, args.precision, args.pipe_partition_method) == (1, "fp16", "type:transformer|mlp")
    assert report["deepspeed_config"]["train_batch_size"] == 4 * 32 * 12
