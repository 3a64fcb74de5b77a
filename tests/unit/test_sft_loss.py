"""The SFT loss as training computes it (megatron.objectives.language_model.forward_loss) against Hugging Face's loss
with labels -100 at the same places, for both model families; documents kept apart in a packed sample."""

from __future__ import annotations

import pytest
import torch

from megatron.data import BatchOptions, get_batch
from megatron.objectives.language_model import forward_loss
from tests.unit.test_model import VOCAB
from tests.unit.test_model_hf_equivalence import gpt_neox_pair, llama_pair

pytestmark = pytest.mark.usefixtures("single_rank_world")


def chat_samples(seed: int = 3) -> dict[str, torch.Tensor]:
    """Two samples of 11 tokens, labels aligned with them: masked prompts, an odd negative, padding."""
    gen = torch.Generator().manual_seed(seed)
    text = torch.randint(1, VOCAB, (2, 11), generator=gen)
    label = text.clone()
    label[0, :4] = -100
    label[0, 7] = -7  # any negative label is masked
    label[1, :6] = -100
    label[1, 9:] = -100
    text[1, 9:] = 0  # padding
    return {"text": text, "label": label}


@pytest.mark.parametrize("pair", [gpt_neox_pair, llama_pair], ids=["gpt-neox", "llama"])
def test_masked_loss_equals_hugging_face_with_labels_minus_100(pair):
    ours, hf = pair()
    samples = chat_samples()
    hf_labels = torch.where(samples["label"] < 0, -100, samples["label"])
    with torch.no_grad():
        expected = hf(input_ids=samples["text"], labels=hf_labels).loss
        actual = forward_loss(ours.eval(), samples)
        unmasked = forward_loss(ours, {"text": samples["text"]})
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    assert abs(unmasked.item() - expected.item()) > 1e-3  # the mask changes the loss: it is not ignored


def test_packed_documents_do_not_see_each_other_with_reset_settings():
    ours, _ = llama_pair()
    ours.eval()
    eod = 0
    first, second = torch.tensor([5, 9, 17, eod]), torch.tensor([33, 41, 8, 60, 2, 7])
    packed = torch.cat([first, second]).unsqueeze(0)
    options = BatchOptions(eod=eod, reset_position_ids=True, reset_attention_mask=True)
    with torch.no_grad():
        alone = ours(second[:-1].unsqueeze(0))
        batch = get_batch({"text": packed}, options)
        together = ours(batch.tokens, position_ids=batch.position_ids, attention_mask=batch.attention_mask)
        leaking = ours(batch.tokens)
    torch.testing.assert_close(together[:, len(first):], alone, atol=1e-5, rtol=1e-5)
    assert (leaking[:, len(first):] - alone).abs().max() > 1e-3  # without them the second document sees the first
