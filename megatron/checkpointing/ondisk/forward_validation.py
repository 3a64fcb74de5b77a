"""`checkpoint_validation_with_forward_pass`: logits of a fixed batch, stored at save, compared at load.

Strict loading proves the keys and shapes; this proves the numbers: a model that loaded the right
names but the wrong values (another tag, a refresh that never happened) gives other logits.
"""

from __future__ import annotations

import torch

from megatron.checkpointing.errors import CheckpointError

_BATCH_TOKENS = 16
_BATCH_SEED = 20240531

# Largest allowed |difference| relative to (1 + largest |logit|), by the coarser precision involved.
_RELATIVE_TOLERANCE = {"fp32": 1e-4, "fp16": 2e-2, "bf16": 6e-2}
_COARSENESS = ["fp32", "fp16", "bf16"]


def validation_tokens(vocab_size: int, seq_length: int) -> torch.Tensor:
    """The same token ids on every rank, every run: a seeded generator, independent of global RNG."""
    generator = torch.Generator().manual_seed(_BATCH_SEED)
    return torch.randint(0, vocab_size, (1, min(_BATCH_TOKENS, seq_length)), generator=generator)


@torch.no_grad()
def forward_logits(engine, tokens: torch.Tensor) -> torch.Tensor:
    from deepspeed.accelerator import get_accelerator

    was_training = engine.training
    engine.eval()
    logits = engine(tokens.to(get_accelerator().current_device_name()))
    engine.train(was_training)
    return logits.float().cpu()


def capture(engine, args) -> dict:
    """What save_checkpoint stores in the client state."""
    tokens = validation_tokens(args.padded_vocab_size, args.seq_length)
    return {"tokens": tokens, "logits": forward_logits(engine, tokens), "precision": args.precision}


def check(engine, precision: str, stored: dict | None, source: str) -> float:
    """Compare the loaded model's logits with the stored ones (`precision`: the run's); returns the relative
    difference."""
    if stored is None:
        raise CheckpointError(
            f"checkpoint_validation_with_forward_pass is set but {source} holds no stored logits "
            "(it was saved without that setting); unset it for this load"
        )
    logits = forward_logits(engine, stored["tokens"])
    expected = stored["logits"]
    if logits.shape != expected.shape:
        raise CheckpointError(
            f"forward-pass validation of {source}: logits have shape {tuple(logits.shape)}, the stored ones "
            f"{tuple(expected.shape)}; the vocabulary differs from the saved model"
        )
    coarser = max(stored.get("precision", "fp32"), precision, key=_COARSENESS.index)
    relative = ((logits - expected).abs().max() / (1.0 + expected.abs().max())).item()
    if relative > _RELATIVE_TOLERANCE[coarser]:
        raise CheckpointError(
            f"forward-pass validation of {source} failed: the loaded model's logits differ from the ones "
            f"stored at save by {relative:.3g} (relative; {coarser} allows {_RELATIVE_TOLERANCE[coarser]:g}). "
            "The weights in the model are not the weights that were saved."
        )
    return relative
