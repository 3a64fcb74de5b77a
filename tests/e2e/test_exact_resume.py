"""A resumed run is bit-identical to one never stopped, its validation and test losses included (CPU fp32,
1 and 2 ranks, dropout on; DeepSpeed's FusedAdam and ZeRO-Offload's DeepSpeedCPUAdam; text and SFT chat data)."""

from __future__ import annotations

import pytest
import torch

from megatron.checkpointing.ondisk.module_weights import read_module_weights
from tests.deepy_runs import run_deepy, tensorboard_scalars, train_lines, write_overrides

pytestmark = pytest.mark.e2e

TRAIN_ITERS = 12
# lr_decay_iters fixed so both halves follow the same schedule; dropout on so RNG restoring matters;
# an evaluation before the stop and two after it, so the validation position must carry over.
SCHEDULE = dict(lr_decay_iters=TRAIN_ITERS, warmup=3 / TRAIN_ITERS, eval_interval=4, hidden_dropout=0.1,
                keep_last_n_checkpoints=None)


def _train(tmp_path, name, save, train_iters, num_gpus, **settings):
    """The run's training lines and its evaluation losses: {"valid/loss": {step: loss}, "test/loss": ...}."""
    tensorboard = tmp_path / f"{name}-tb"
    overrides = write_overrides(tmp_path, name=f"{name}.yml", save=str(save), train_iters=train_iters,
                                num_gpus=num_gpus, tensorboard_dir=str(tensorboard), **SCHEDULE, **settings)
    lines = train_lines(run_deepy(["configs/tiny.yml", overrides]).stdout)
    scalars = tensorboard_scalars(tensorboard)
    return lines, {tag: scalars.get(tag, {}) for tag in ("valid/loss", "test/loss")}


def _chat_data(tmp_path) -> dict:
    """SFT settings over chats of many lengths made by the chat preprocess tool: token and label files for
    training, validation and test, one unpacked sample per chat, so which samples come next is the label datasets'
    position (their order is seeded by the number of samples GPT-NeoX asks of them)."""
    from tests.e2e.test_preprocess_chat import WORDS, make_chat_tokenizer, run, write_jsonl

    words = torch.Generator().manual_seed(0)

    def say(most: int) -> str:
        count = int(torch.randint(1, most + 1, (1,), generator=words))
        return " ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (count,), generator=words))

    chats = [{"messages": [message for _ in range(1 + i % 2) for message in
                           ({"role": "user", "content": say(3)}, {"role": "assistant", "content": say(3)})]}
             for i in range(48)]
    tokenizer = make_chat_tokenizer(tmp_path / "tok", eos="<|endoftext|>")
    run("--input", write_jsonl(tmp_path / "chats.jsonl", chats), "--tokenizer-path", str(tokenizer),
        "--jsonl-keys", "messages", "--output-prefix", str(tmp_path / "sft"))
    tokens, labels = [str(tmp_path / "sft_messages_document")], [str(tmp_path / "sft_messages_label_document")]
    return dict(embedded_corpus=False, tokenizer_type="HFTokenizer", vocab_file=str(tokenizer / "tokenizer.json"),
                seq_length=24, pack_impl="unpacked", allow_chopped=False, train_data_paths=tokens,
                train_label_data_paths=labels, valid_data_paths=tokens, valid_label_data_paths=labels,
                test_data_paths=tokens, test_label_data_paths=labels)


def _offload(tmp_path) -> dict:
    """ZeRO-Offload: the optimizer step runs in DeepSpeedCPUAdam, not FusedAdam."""
    return {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}


# The first half is the unbroken run's own tag at the stop (extra_save_iters), resumed into another directory
# with the same settings: unpacked SFT samples are ordered by how many samples the run asks for (as GPT-NeoX
# orders them), so a first half trained with fewer train_iters would have trained on other samples.
# Two cases, each run twice: two ranks with ZeRO-Offload's optimizer (the data position and RNG of every rank,
# DeepSpeedCPUAdam's state), one rank of SFT chat data with FusedAdam (the label datasets' position).
@pytest.mark.parametrize("num_gpus, settings_in", [
    pytest.param(2, _offload, id="2-zero_offload", marks=pytest.mark.distributed),
    pytest.param(1, _chat_data, id="1-sft"),
])
@pytest.mark.slow
def test_stop_and_resume_gives_the_bits_of_an_unbroken_run(tmp_path, num_gpus, settings_in):
    settings = settings_in(tmp_path)
    unbroken, unbroken_evaluations = _train(tmp_path, "unbroken", tmp_path / "unbroken", TRAIN_ITERS, num_gpus,
                                            extra_save_iters=[TRAIN_ITERS // 2], **settings)
    resumed, resumed_evaluations = _train(tmp_path, "second", tmp_path / "second", TRAIN_ITERS, num_gpus,
                                          load=str(tmp_path / "unbroken"), iteration=TRAIN_ITERS // 2, **settings)

    assert resumed[0].iteration == TRAIN_ITERS // 2 + 1
    assert [(line.iteration, line.loss) for line in resumed] == \
        [(line.iteration, line.loss) for line in unbroken if line.iteration > TRAIN_ITERS // 2]
    expected = read_module_weights(tmp_path / "unbroken" / f"global_step{TRAIN_ITERS}")
    actual = read_module_weights(tmp_path / "second" / f"global_step{TRAIN_ITERS}")
    differing = {name: int((expected[name] != actual[name]).sum()) for name in expected}
    assert not any(differing.values()), f"elements that differ from the unbroken run: {differing}"
    assert all(torch.equal(expected[name], actual[name]) for name in expected)

    # Validation continues where the first half left it (and the final test reads what the unbroken one read).
    assert sorted(unbroken_evaluations["valid/loss"]) == [4, 8, 12]
    assert resumed_evaluations["valid/loss"] == {step: loss for step, loss in unbroken_evaluations["valid/loss"].items()
                                                 if step > TRAIN_ITERS // 2}
    assert resumed_evaluations["test/loss"] == unbroken_evaluations["test/loss"] != {}
