"""End to end: pretrain the tiny config, drop the optimizer files, fine-tune with configs/finetune.yml."""

from __future__ import annotations

import re

import pytest
import torch

from megatron.checkpointing.ondisk.module_weights import read_module_weights
from megatron.hf import load_hf_module_weights
from megatron.hf.config import spec_from_hf_config
from tests.deepy_runs import TRAIN_LINE, checkpoint_files, run_deepy, train_lines, write_overrides

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A tiny fp32 ZeRO-1 checkpoint after 60 steps, with its optimizer files deleted."""
    directory = tmp_path_factory.mktemp("pretrain")
    save = directory / "ckpt"
    overrides = write_overrides(directory, save=str(save), train_iters=60, checkpoint_factor=60,
                                eval_interval=1000, log_interval=1)
    lines = train_lines(run_deepy(["configs/tiny.yml", overrides]).stdout)
    tag_dir = save / "global_step60"
    optimizer_files = [tag_dir / name for name in checkpoint_files(tag_dir) if name.endswith("optim_states.pt")]
    assert optimizer_files, "the pretraining run saved no optimizer files to delete"
    for path in optimizer_files:
        path.unlink()
    return save, lines


def _first_losses(configs: list, tmp_path, name: str, save, **settings) -> list:
    overrides = write_overrides(tmp_path, name=f"{name}.yml", load=str(save), save=str(tmp_path / name),
                                eval_interval=1000, **settings)
    return train_lines(run_deepy([*configs, overrides]).stdout)


@pytest.mark.slow
def test_finetune_in_bf16_zero2_starts_from_the_loaded_weights(pretrained, tmp_path):
    save, pretrain_lines = pretrained
    fresh_loss = pretrain_lines[0].loss  # the random init on the first batch of the data
    # The saved model on that same first batch: fine-tune one step in the precision it was saved in.
    reference = _first_losses(["configs/tiny.yml"], tmp_path, "reference", save, finetune=True, train_iters=1,
                              checkpoint_factor=1)[0].loss
    assert fresh_loss - reference > 1.0, "pretraining did not move far enough from the init to tell"

    lines = _first_losses(["configs/tiny.yml", "configs/finetune.yml"], tmp_path, "finetuned", save,
                          train_iters=5, checkpoint_factor=5)
    assert lines[0].iteration == 1, "finetune must restart the iteration count"
    assert lines[0].loss == pytest.approx(reference, abs=0.05), "bf16 ZeRO-2 did not start from the saved weights"
    # The fp32 master weights were refreshed: later steps do not fall back towards the random init.
    assert all(line.loss < fresh_loss - 1.0 for line in lines)
    assert (tmp_path / "finetuned" / "latest").read_text().strip() == "global_step5"


def test_full_resume_of_a_checkpoint_without_optimizer_files_is_refused(pretrained, tmp_path):
    save, _ = pretrained
    overrides = write_overrides(tmp_path, load=str(save), save=str(tmp_path / "resumed"), train_iters=70)
    result = run_deepy(["configs/tiny.yml", overrides], expect_success=False)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "no_load_optim" in output and "finetune" in output
    assert TRAIN_LINE.search(output) is None


def test_load_pointing_at_nothing_is_an_error_not_a_fresh_start(tmp_path):
    missing = tmp_path / "no-such-checkpoint"
    overrides = write_overrides(tmp_path, load=str(missing), save=str(tmp_path / "out"), train_iters=5)
    result = run_deepy(["configs/tiny.yml", overrides], expect_success=False)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert str(missing) in output
    assert TRAIN_LINE.search(output) is None


SHORT_FINETUNE = {"finetune": True, "embedded_corpus": True, "train_iters": 3, "eval_interval": 1000,
                  "optimizer": {"type": "Adam", "params": {"lr": 0.0001}}}


@pytest.mark.slow
def test_one_short_finetune_file_takes_the_model_from_the_checkpoint(pretrained, tmp_path):
    """`python deepy.py train.py finetune.yml` with no model setting: the shape comes from the checkpoint."""
    save, pretrain_lines = pretrained
    finetune = write_overrides(tmp_path, name="finetune.yml", load=str(save), save=str(tmp_path / "out"),
                               **SHORT_FINETUNE)
    result = run_deepy([finetune])
    lines = train_lines(result.stdout)
    assert lines[0].iteration == 1 and len(lines) == 3
    assert lines[0].loss < pretrain_lines[0].loss - 1.0, "did not start from the pretrained weights"
    assert "model settings taken from" in result.stdout and "num_layers" in result.stdout

    result = run_deepy([finetune, write_overrides(tmp_path, name="wider.yml", hidden_size=256)],
                       expect_success=False)
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "hidden_size: saved 128, now 256" in output
    assert TRAIN_LINE.search(output) is None


def test_one_short_finetune_file_takes_the_model_from_a_hugging_face_folder(tmp_path):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    hf_dir = tmp_path / "hf"
    config = GPTNeoXConfig(vocab_size=4096, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=64, max_position_embeddings=64)  # 4096: the embedded corpus's tokens
    GPTNeoXForCausalLM(config).save_pretrained(hf_dir)
    finetune = write_overrides(tmp_path, name="finetune.yml", load=str(hf_dir), save=str(tmp_path / "out"),
                               **SHORT_FINETUNE)
    result = run_deepy([finetune])
    assert [line.iteration for line in train_lines(result.stdout)] == [1, 2, 3]
    assert f"model settings taken from {hf_dir / 'config.json'}" in result.stdout


def test_a_mixtral_folder_fine_tunes_with_its_load_balancing_loss_in_the_log(tmp_path):
    from transformers import MixtralConfig, MixtralForCausalLM

    hf_dir = tmp_path / "hf"
    config = MixtralConfig(vocab_size=4096, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=64, output_router_logits=True, router_aux_loss_coef=0.02)
    MixtralForCausalLM(config).save_pretrained(hf_dir)
    finetune = write_overrides(tmp_path, name="finetune.yml", load=str(hf_dir), save=str(tmp_path / "out"),
                               **{**SHORT_FINETUNE, "train_iters": 4, "weight_decay": 0.0,
                                  "optimizer": {"type": "Adam", "params": {"lr": 0.003}}})
    result = run_deepy([finetune])
    assert f"model settings taken from {hf_dir / 'config.json'}" in result.stdout
    assert "mixture of experts: 4 experts 48 wide in every layer, top 2 renormalised" in result.stdout
    lines = [(int(m[1]), *map(float, m.groups()[1:])) for m in MOE_LINE.finditer(result.stdout)]
    assert [line[0] for line in lines] == [1, 2, 3, 4], result.stdout[-3000:]
    for _, loss, lm_loss, balance in lines:
        assert balance >= 2 - 1e-4  # top_k at best, when every expert gets its share
        assert loss == pytest.approx(lm_loss + 0.02 * balance, abs=2e-4)
    # it trains: every expert and router moved from the folder's weights (by its gradient: no weight decay)
    loaded = load_hf_module_weights(hf_dir, spec_from_hf_config(config.to_dict()).architecture())
    trained = read_module_weights(tmp_path / "out" / "global_step4")
    for layer in (2, 3):
        assert not torch.equal(trained[f"sequential.{layer}.mlp.router.layer.weight"],
                               loaded[f"sequential.{layer}.mlp.router.layer.weight"])
        for name in ("w1", "w3", "w2"):
            key = f"sequential.{layer}.mlp.experts.mlp.{name}"
            for before, after in zip(loaded[key].chunk(4), trained[key].chunk(4), strict=True):
                assert not torch.equal(before, after), f"{key}: an expert did not train"


MOE_LINE = re.compile(r"iteration\s+(\d+)/\d+ \| loss ([\d.]+) \| lm_loss ([\d.]+) \| load_balancing_loss ([\d.]+) \|")
