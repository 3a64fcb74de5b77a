"""train_impl rm: the scalar head, the reward read at the first appended end token, the loss and its gradients
against transformers' GPTNeoX/LlamaForSequenceClassification (an independent computation: transformers reads
the score at the last token that is not padding, of the chat + ONE eos), for both families, micro batches
of 2 and 1; tensor parallel 2 on 2 ranks (tests/distributed/reward_model_worker.py)."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers import (
    GPTNeoXConfig,
    GPTNeoXForSequenceClassification,
    LlamaConfig,
    LlamaForSequenceClassification,
)

from megatron.contract.architecture import ModelConfigError
from megatron.data import BatchOptions
from megatron.model import build_model
from megatron.neox_arguments import ConfigError, NeoXArgs
from megatron.objectives import objective_for
from tests.conftest import run_rank_worker
from tests.unit.test_model import HEADS, HIDDEN, LLAMA, NEOX, VOCAB, tiny_args
from tests.unit.test_model_hf_equivalence import LAYERS, llama_state_from_hf, neox_state_from_hf, randomize_
from tests.worker_report import reported

PAD, EOS, M = 0, 1, -100
SEQ = 12
RM = dict(train_impl="rm", dataset_impl="pairwise", pack_impl="unpacked", no_weight_tying=True)
HEAD = f"sequential.{LAYERS + 4}.rm_linear.weight"


def hf_config(family: str):
    if family == "gpt_neox":
        return GPTNeoXConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                             intermediate_size=4 * HIDDEN, hidden_act="gelu", rotary_pct=0.25, rotary_emb_base=10000,
                             max_position_embeddings=32, layer_norm_eps=1e-5, use_parallel_residual=True,
                             tie_word_embeddings=False, attention_dropout=0.0, hidden_dropout=0.0, num_labels=1,
                             pad_token_id=PAD, eos_token_id=EOS, attn_implementation="eager")
    return LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=LAYERS,
                       num_attention_heads=HEADS, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=500000.0,
                       max_position_embeddings=32, tie_word_embeddings=False, attention_dropout=0.0, num_labels=1,
                       pad_token_id=PAD, eos_token_id=EOS, attn_implementation="eager")


def hf_to_our_names(family: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The test's own mapping (tests/unit/test_model_hf_equivalence.py), with `score` as our head."""
    body = {name: value for name, value in tensors.items() if name != "score.weight"}
    holder = SimpleNamespace(state_dict=lambda: body)
    # tied=True: the sequence classifier has no lm_head to map
    ours = neox_state_from_hf(holder) if family == "gpt_neox" else llama_state_from_hf(holder, 2, tied=True)
    return {**ours, HEAD: tensors["score.weight"]}


def rm_pair(family: str):
    """(our reward model, transformers' sequence classifier) holding the same random weights."""
    torch.manual_seed(0)
    cls = GPTNeoXForSequenceClassification if family == "gpt_neox" else LlamaForSequenceClassification
    hf = cls(hf_config(family)).eval()
    randomize_(hf)
    settings = {**(NEOX if family == "gpt_neox" else LLAMA), **RM}
    if family == "gpt_neox":
        settings.update(layernorm_epsilon=1e-5, rotary_emb_base=10000)
    ours = build_model(tiny_args(settings).architecture(), seed=1234)
    ours.load_state_dict(hf_to_our_names(family, hf.state_dict()), strict=True)
    return ours, hf


def for_rm(chat: list[int]) -> tuple[list[int], list[int]]:
    """preprocess_data_with_chat_template.py --for-rm's layout: tokens + [eos, eos], labels masked but the last."""
    return chat + [EOS, EOS], [M] * (len(chat) + 1) + [EOS]


def pad(values: list[int], value: int) -> list[int]:
    return (values + [value] * (SEQ + 1))[: SEQ + 1]


def pairs(lengths: list[tuple[int, int]], seed: int = 4) -> tuple[dict[str, torch.Tensor], list[list[int]]]:
    """Pairwise samples of random chats of the given (chosen, rejected) lengths, and the chats themselves
    (chosen rows, then rejected rows)."""
    gen = torch.Generator().manual_seed(seed)
    chats = {"pos": [], "neg": []}
    for lengths_of_pair in lengths:
        for side, length in zip(("pos", "neg"), lengths_of_pair, strict=True):
            chats[side].append(torch.randint(2, VOCAB, (length,), generator=gen).tolist())
    samples = {}
    for side in ("pos", "neg"):
        laid_out = [for_rm(chat) for chat in chats[side]]
        samples[side] = torch.tensor([pad(tokens, PAD) for tokens, _ in laid_out])
        samples[f"{side}_label"] = torch.tensor([pad(labels, M) for _, labels in laid_out])
    return samples, chats["pos"] + chats["neg"]


def hf_scores(hf, chats: list[list[int]]) -> torch.Tensor:
    """transformers' scores of chat + one eos, right-padded with the pad token (read at the last non-pad token)."""
    width = max(len(chat) for chat in chats) + 1
    inputs = torch.tensor([(chat + [EOS] + [PAD] * width)[:width] for chat in chats])
    return hf(input_ids=inputs).logits[:, 0]


def expected_loss(scores: torch.Tensor, z_loss: float) -> torch.Tensor:
    chosen, rejected = scores.chunk(2)
    return -F.logsigmoid(chosen - rejected).mean() + (z_loss * (chosen**2 + rejected**2)).mean()


pytestmark_single = pytest.mark.usefixtures("single_rank_world")


@pytestmark_single
@pytest.mark.parametrize("family", ["gpt_neox", "llama"])
@pytest.mark.parametrize("lengths", [[(5, 8), (9, 3)], [(6, 4)]], ids=["micro2", "micro1"])
def test_loss_and_gradients_equal_transformers_sequence_classifier(family, lengths):
    ours, hf = rm_pair(family)
    samples, chats = pairs(lengths)
    objective = objective_for(tiny_args({**RM, "z_loss": 0.3}), BatchOptions())
    ours.train()
    loss, metrics = objective(ours, samples)
    loss.backward()
    hf.train()
    scores = hf_scores(hf, chats)
    reference = expected_loss(scores, 0.3)
    reference.backward()
    torch.testing.assert_close(loss, reference, atol=1e-5, rtol=1e-5)
    chosen, rejected = scores.detach().chunk(2)
    torch.testing.assert_close(metrics["margin"], (chosen - rejected).mean(), atol=1e-5, rtol=1e-5)
    assert metrics["accuracy"].item() == ((chosen - rejected) > 0).float().mean().item()
    torch.testing.assert_close(metrics["pos_values"], chosen.mean(), atol=1e-5, rtol=1e-5)
    expected_grads = hf_to_our_names(family, {n: p.grad for n, p in hf.named_parameters()})
    grads = {n: p.grad for n, p in ours.named_parameters()}
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], atol=1e-5, rtol=1e-4, msg=name)
    assert grads[HEAD].abs().sum() > 0


@pytestmark_single
def test_identical_chosen_and_rejected_give_ln2_plus_the_z_term():
    ours, hf = rm_pair("llama")
    samples, chats = pairs([(7, 7), (4, 4)])
    samples["neg"], samples["neg_label"] = samples["pos"], samples["pos_label"]
    objective = objective_for(tiny_args({**RM, "z_loss": 0.5}), BatchOptions())
    with torch.no_grad():
        loss, metrics = objective(ours.eval(), samples)
        scores = hf_scores(hf, chats[:2])
    assert math.isclose(loss.item(), math.log(2) + 0.5 * (2 * scores**2).mean().item(), rel_tol=1e-5)
    assert metrics["accuracy"].item() == 0.0 and metrics["margin"].item() == 0.0
    assert (scores.abs() > 1e-3).all()  # the z term is really there


@pytestmark_single
def test_the_reward_is_read_at_the_first_appended_eos_not_the_second():
    ours, _ = rm_pair("gpt_neox")
    samples, chats = pairs([(5, 6)])
    with torch.no_grad():
        values = ours.eval()(samples["pos"][:, :-1])[0, :, 0]
        _, metrics = objective_for(tiny_args(RM), BatchOptions())(ours, samples)
    first_eos = len(chats[0])
    assert metrics["pos_values"].item() == pytest.approx(values[first_eos].item(), abs=1e-6)
    assert values[first_eos + 1].item() != pytest.approx(values[first_eos].item(), abs=1e-4)


RUN = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32, "train_iters": 10,
       "optimizer": {"type": "Adam", "params": {"lr": 0.001}}, "train_micro_batch_size_per_gpu": 1,
       "tokenizer_type": "ByteLevelTokenizer", "pos_train_data_paths": ["p"], "neg_train_data_paths": ["n"],
       "pos_train_label_data_paths": ["pl"], "neg_train_label_data_paths": ["nl"], **RM}


@pytest.mark.parametrize("change, says", [
    ({"no_weight_tying": False}, "no_weight_tying.*set no_weight_tying: true"),
    ({"dataset_impl": "gpt2", "pos_train_data_paths": None, "neg_train_data_paths": None,
      "pos_train_label_data_paths": None, "neg_train_label_data_paths": None, "train_data_paths": ["x"]},
     "dataset_impl.*set dataset_impl: pairwise"),
    ({"pack_impl": "packed"}, "pack_impl.*which packed cuts apart: set pack_impl: unpacked"),
    ({"pack_impl": "pack_until_overflow"}, "pack_impl.*only with reset_attention_mask: true"),
    ({"eod_mask_loss": True}, "eod_mask_loss.*remove it"),
    ({"pos_train_label_data_paths": None, "neg_train_label_data_paths": None}, "pos_train_data_paths: train_impl rm "
     "reads each reward at the position its labels train"),
])
def test_reward_model_settings_are_checked_in_one_line(change, says):
    with pytest.raises(ConfigError, match=says) as caught:
        NeoXArgs.from_dict({**RUN, **change}, require_run_settings=True)
    assert "\n" not in str(caught.value)


@pytestmark_single
def test_a_reward_head_needs_untied_embeddings():
    arch = tiny_args(RM).architecture()
    with pytest.raises(ModelConfigError, match="no_weight_tying: true"):
        build_model(type(arch)(**{**arch.__dict__, "tied_embeddings": True}), seed=1)


WORKER = Path(__file__).with_name("reward_model_worker.py")


@pytest.mark.distributed
@pytest.mark.slow
def test_tensor_parallel_2_has_transformers_loss_and_gradients(tmp_path):
    records = run_rank_worker(WORKER)
    for family in ("gpt_neox", "llama"):
        assert reported(records, case=f"{family} tp2", ok=True), records


@pytestmark_single
def test_the_load_plan_gives_a_reward_model_from_a_language_model_a_fresh_head(tmp_path):
    from megatron.checkpointing.errors import CheckpointError
    from megatron.checkpointing.ondisk.inventory import inventory_checkpoint
    from megatron.checkpointing.planning.plan import build_load_plan
    from megatron.hf import HF_FOLDER
    from tests.ckpt_engines import make_args, saved_checkpoint

    lm = saved_checkpoint(tmp_path / "lm", make_args(no_weight_tying=True))
    rm = saved_checkpoint(tmp_path / "rm", make_args(**RM))

    def plan(load, **settings):
        return build_load_plan(make_args(load=str(load), **RM, **settings), inventory_checkpoint(load, HF_FOLDER), 1)

    fresh = plan(lm, finetune=True)
    assert fresh.fresh_reward_head and "reward head rm_linear (drawn from the seed" in fresh.describe()
    assert plan(lm, no_load_optim=True).fresh_reward_head
    assert not plan(rm, finetune=True).fresh_reward_head and not plan(rm).fresh_reward_head
    with pytest.raises(CheckpointError, match="set `finetune: true`") as caught:
        plan(lm)
    assert "\n" not in str(caught.value)
