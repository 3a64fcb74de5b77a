"""End to end: pretrain the tiny config, drop the optimizer files, fine-tune with configs/finetune.yml."""

from __future__ import annotations

import re

import pytest
import torch

from megatron.checkpointing.ondisk.module_weights import read_module_weights
from megatron.hf import load_hf_module_weights
from megatron.hf.config import spec_from_hf_config
from tests.deepy_runs import (
    TRAIN_LINE,
    checkpoint_files,
    run_deepy,
    tensorboard_scalars,
    train_lines,
    write_overrides,
)

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
    # Rows of 2: bf16 matrix products are slow on CPUs without AVX-512, and both runs read the same first batch.
    reference = _first_losses(["configs/tiny.yml"], tmp_path, "reference", save, finetune=True, train_iters=1,
                              checkpoint_factor=1, train_micro_batch_size_per_gpu=2)[0].loss
    assert fresh_loss - reference > 1.0, "pretraining did not move far enough from the init to tell"

    lines = _first_losses(["configs/tiny.yml", "configs/finetune.yml"], tmp_path, "finetuned", save,
                          train_iters=5, checkpoint_factor=5, train_micro_batch_size_per_gpu=2)
    assert lines[0].iteration == 1, "finetune must restart the iteration count"
    assert lines[0].loss == pytest.approx(reference, abs=0.05), "bf16 ZeRO-2 did not start from the saved weights"
    # The fp32 master weights were refreshed: later steps do not fall back towards the random init.
    assert all(line.loss < fresh_loss - 1.0 for line in lines)
    assert (tmp_path / "finetuned" / "latest").read_text().strip() == "global_step5"


@pytest.mark.slow
def test_full_resume_of_a_checkpoint_without_optimizer_files_is_refused(pretrained, tmp_path):
    save, _ = pretrained
    overrides = write_overrides(tmp_path, load=str(save), save=str(tmp_path / "resumed"), train_iters=70)
    result = run_deepy(["configs/tiny.yml", overrides], expect_success=False)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "no_load_optim" in output and "finetune" in output
    assert TRAIN_LINE.search(output) is None


@pytest.mark.slow
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


@pytest.mark.slow
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


def tiny_mixtral(top_k: int = 2, output_router_logits: bool = True, seed: int = 0):
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=4096, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=48, num_local_experts=4, num_experts_per_tok=top_k,
                           max_position_embeddings=64, output_router_logits=output_router_logits,
                           router_aux_loss_coef=0.02)
    torch.manual_seed(seed)  # transformers draws from the global stream, whose state depends on the tests run before
    return MixtralForCausalLM(config)


def expert_loads(scalars: dict, layer: int, step: int) -> list[float]:
    return [scalars[f"train/expert_load/layer_{layer}/expert_{expert}"][step] for expert in range(4)]


@pytest.mark.slow
def test_a_mixtral_folder_fine_tunes_with_its_load_balancing_loss_and_expert_load_in_the_log(tmp_path):
    model = tiny_mixtral()
    hf_dir = tmp_path / "hf"
    model.save_pretrained(hf_dir)
    finetune = write_overrides(tmp_path, name="finetune.yml", load=str(hf_dir), save=str(tmp_path / "out"),
                               tensorboard_dir=str(tmp_path / "tb"), moe_collapse_steps=1,
                               **{**SHORT_FINETUNE, "train_iters": 4, "weight_decay": 0.0,
                                  "optimizer": {"type": "Adam", "params": {"lr": 0.003}}})
    result = run_deepy([finetune])
    assert f"model settings taken from {hf_dir / 'config.json'}" in result.stdout
    assert "mixture of experts: 4 experts 48 wide in every layer, top 2 renormalised" in result.stdout
    lines = [(int(m[1]), *map(float, m.groups()[1:])) for m in MOE_LINE.finditer(result.stdout)]
    assert [line[0] for line in lines] == [1, 2, 3, 4], result.stdout[-3000:]
    for _, loss, lm_loss, balance, _ in lines:
        assert 0 < balance <= 4  # at most the number of experts: every slot and all probability on one expert
        assert loss == pytest.approx(lm_loss + 0.02 * balance, abs=2e-4)
    # TensorBoard: every expert's share of its layer's routed slots at every step, the line's largest of them
    scalars = tensorboard_scalars(tmp_path / "tb")
    for step, *_, max_load in lines:
        loads = [expert_loads(scalars, layer, step) for layer in (0, 1)]
        for layer_loads in loads:
            assert sum(layer_loads) == pytest.approx(1.0, abs=1e-6)
        assert max_load == pytest.approx(max(max(layer_loads) for layer_loads in loads), abs=1e-4)
        assert scalars["train/load_balancing_loss"][step] == pytest.approx(lines[step - 1][3], abs=1e-4)
    assert "router collapse" not in result.stdout  # even with moe_collapse_steps 1: a random router spreads
    # it trains: every expert and router moved from the folder's weights (by its gradient: no weight decay)
    loaded = load_hf_module_weights(hf_dir, spec_from_hf_config(model.config.to_dict()).architecture())
    trained = read_module_weights(tmp_path / "out" / "global_step4")
    for layer in (2, 3):
        assert not torch.equal(trained[f"sequential.{layer}.mlp.router.layer.weight"],
                               loaded[f"sequential.{layer}.mlp.router.layer.weight"])
        for name in ("w1", "w3", "w2"):
            key = f"sequential.{layer}.mlp.experts.mlp.{name}"
            for before, after in zip(loaded[key].chunk(4), trained[key].chunk(4), strict=True):
                assert not torch.equal(before, after), f"{key}: an expert did not train"


@pytest.mark.slow
def test_a_router_sending_every_token_to_one_expert_is_reported_in_one_line(tmp_path):
    """Layer 0 made to route every token to expert 2: its attention adds nothing, every token's embedding is
    positive in one coordinate, the norm before the experts keeps only that coordinate, and the router's
    column for it favours expert 2 by far. Layer 1 routes as initialised."""
    # behind the made-up layer 0 many seeds' layer 1 collapses too; this one's spreads its tokens
    model = tiny_mixtral(top_k=1, output_router_logits=False, seed=4)
    layer = model.model.layers[0]
    with torch.no_grad():
        coordinate = 5
        layer.self_attn.o_proj.weight.zero_()
        embeddings = model.model.embed_tokens.weight
        embeddings[:, coordinate] = embeddings[:, coordinate].abs() + 1
        layer.post_attention_layernorm.weight.zero_()
        layer.post_attention_layernorm.weight[coordinate] = 1
        layer.mlp.gate.weight[:, coordinate] = torch.tensor([-5.0, -5.0, 5.0, -5.0])
    model.save_pretrained(tmp_path / "hf")
    finetune = write_overrides(tmp_path, name="finetune.yml", load=str(tmp_path / "hf"),
                               tensorboard_dir=str(tmp_path / "tb"), moe_collapse_steps=3, **SHORT_FINETUNE)
    result = run_deepy([finetune])
    collapses = [line for line in result.stdout.splitlines() if "router collapse" in line]
    assert len(collapses) == 1, result.stdout[-3000:]
    assert "router collapse: layer 0 sent 100% of its tokens to expert 2 in each of the 3 steps to 3" in collapses[0]
    scalars = tensorboard_scalars(tmp_path / "tb")
    for step in (1, 2, 3):
        assert expert_loads(scalars, 0, step) == [0.0, 0.0, 1.0, 0.0]
        assert max(expert_loads(scalars, 1, step)) < 0.9


MOE_LINE = re.compile(r"iteration\s+(\d+)/\d+ \| loss ([\d.]+) \| lm_loss ([\d.]+) \| load_balancing_loss ([\d.]+) \| "
                      r"max_expert_load ([\d.]+) \|")
