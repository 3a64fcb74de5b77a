"""What a checkpoint stores besides the weights, and the one place its keys are spelled.

DeepSpeed writes a client state as top-level keys of the tag's model-states file, next to its own
keys (module, optimizer, global_steps, ...). GPT-NeoX writes ``iteration`` and ``args`` the same way,
so one of its checkpoints reads as a client state whose other fields are unset.

Format versions (``checkpoint_format_version``; a checkpoint without the key predates it or was
written by another program, and is read as far as its keys go):

1. iteration, consumed_train_samples, args (the run's settings), rng_states (one per global rank),
   lr_schedule_start_iteration, forward_validation (with checkpoint_validation_with_forward_pass),
   converted_from (checkpoints written by the HF converter), lr_schedule (peak_lr, min_lr,
   warmup_iters, decay_iters, decay_style: what resumes check against the configs; absent in
   checkpoints saved before it was recorded), consumed_valid_samples (validation samples the run's
   evaluations read, where the next evaluation continues; absent in GPT-NeoX's checkpoints and in ours
   saved before it was recorded, where megatron.checkpointing.planning.data_position derives it as GPT-NeoX does),
   reference_model (DPO/KTO runs: source, tag and checksum of the frozen reference, see reference.py),
   lora_base (a LoRA run's adapter-only tag: source, tag and checksum of the frozen base the adapters were
   trained over and the Hugging Face folder holding it, when one does; the tag holds only the parameters that
   train, identity.LoraBase), rollouts (REINFORCE runs sampling here: each global rank's sampler generator
   state and moving-average baseline, megatron.rollouts), reward_model (REINFORCE runs scored by a reward model:
   its source, tag and checksum, identity.RewardModelIdentity).
2. args: intermediate_size has GPT-NeoX's meaning (the width before GPT-NeoX's MLP rule, see
   megatron/contract/architecture.py); in format 1 it was the MLP width per projection as built, and
   ``settings`` reads it in today's meaning.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron.checkpointing.errors import CheckpointError
from megatron.contract.architecture import GATED_ACTIVATIONS

FORMAT_VERSION = 2  # raise when the meaning of a stored key changes; describe the change above
FORMAT_VERSION_KEY = "checkpoint_format_version"
ITERATION_KEY = "iteration"
CONSUMED_SAMPLES_KEY = "consumed_train_samples"
CONSUMED_VALID_SAMPLES_KEY = "consumed_valid_samples"
SETTINGS_KEY = "args"  # GPT-NeoX's name
RNG_STATES_KEY = "rng_states"
LR_SCHEDULE_START_KEY = "lr_schedule_start_iteration"
LR_SCHEDULE_KEY = "lr_schedule"
FORWARD_VALIDATION_KEY = "forward_validation"
CONVERTED_FROM_KEY = "converted_from"
REFERENCE_MODEL_KEY = "reference_model"
LORA_BASE_KEY = "lora_base"
ROLLOUTS_KEY = "rollouts"
REWARD_MODEL_KEY = "reward_model"


@dataclass(frozen=True)
class ClientState:
    iteration: int | None = None
    consumed_train_samples: int | None = None  # GPT-NeoX does not record it
    consumed_valid_samples: int | None = None  # nor this (megatron.checkpointing.planning.data_position derives it)
    settings: dict[str, Any] | None = None  # every setting of the run that saved it, in today's meaning
    rng_states: list[dict[str, Any]] | None = None  # megatron.checkpointing.ondisk.rng states, by global rank
    # The iteration the LR schedule counts from (see megatron.training.loop.TrainState); 0 when not recorded.
    lr_schedule_start: int = 0
    lr_schedule: dict[str, Any] | None = None  # megatron.training.learning_rates.Schedule.to_dict() of the saving run
    forward_validation: dict[str, Any] | None = None  # megatron.checkpointing.ondisk.forward_validation.capture
    converted_from: str | None = None  # the Hugging Face folder the weights came from
    reference_model: dict[str, Any] | None = None  # megatron.checkpointing.ondisk.identity.ReferenceIdentity.to_dict()
    lora_base: dict[str, Any] | None = None  # identity.LoraBase.to_dict(): set, the tag holds the adapters alone
    rollouts: list[dict[str, Any]] | None = None  # REINFORCE's rollout state (megatron.rollouts), by global rank
    reward_model: dict[str, Any] | None = None  # identity.RewardModelIdentity.to_dict(): REINFORCE's scorer
    format_version: int | None = FORMAT_VERSION  # None: written by another program or before versions

    def to_dict(self) -> dict[str, Any]:
        """The keys to hand to DeepSpeed's save; unset optional fields are left out."""
        stored: dict[str, Any] = {
            FORMAT_VERSION_KEY: FORMAT_VERSION,
            ITERATION_KEY: self.iteration,
            CONSUMED_SAMPLES_KEY: self.consumed_train_samples,
            CONSUMED_VALID_SAMPLES_KEY: self.consumed_valid_samples,
            SETTINGS_KEY: self.settings,
            LR_SCHEDULE_START_KEY: self.lr_schedule_start,
        }
        optional = {RNG_STATES_KEY: self.rng_states, FORWARD_VALIDATION_KEY: self.forward_validation,
                    CONVERTED_FROM_KEY: self.converted_from, LR_SCHEDULE_KEY: self.lr_schedule,
                    REFERENCE_MODEL_KEY: self.reference_model, LORA_BASE_KEY: self.lora_base,
                    ROLLOUTS_KEY: self.rollouts, REWARD_MODEL_KEY: self.reward_model}
        stored.update({key: value for key, value in optional.items() if value is not None})
        return stored

    @classmethod
    def from_dict(cls, stored: dict[str, Any]) -> ClientState:
        """Read what a model-states file (or DeepSpeed's load_checkpoint) returned; unknown keys are ignored.

        Never raises: a newer format is reported by `check_readable`, which the load plan calls.
        """
        def integer(key: str) -> int | None:
            value = stored.get(key)
            return int(value) if value is not None else None

        rng_states = stored.get(RNG_STATES_KEY)
        return cls(
            iteration=integer(ITERATION_KEY),
            consumed_train_samples=integer(CONSUMED_SAMPLES_KEY),
            consumed_valid_samples=integer(CONSUMED_VALID_SAMPLES_KEY),
            settings=_settings_today(_settings_dict(stored.get(SETTINGS_KEY)), integer(FORMAT_VERSION_KEY)),
            rng_states=list(rng_states) if rng_states else None,
            lr_schedule_start=integer(LR_SCHEDULE_START_KEY) or 0,
            lr_schedule=stored.get(LR_SCHEDULE_KEY),
            forward_validation=stored.get(FORWARD_VALIDATION_KEY),
            converted_from=stored.get(CONVERTED_FROM_KEY),
            reference_model=stored.get(REFERENCE_MODEL_KEY),
            lora_base=stored.get(LORA_BASE_KEY),
            rollouts=stored.get(ROLLOUTS_KEY),
            reward_model=stored.get(REWARD_MODEL_KEY),
            format_version=integer(FORMAT_VERSION_KEY),
        )

    def check_readable(self, source: Path | str) -> None:
        if self.format_version is not None and self.format_version > FORMAT_VERSION:
            raise CheckpointError(
                f"{source} was written in checkpoint format {self.format_version}, this program reads up to "
                f"format {FORMAT_VERSION}; load it with the newer version that saved it."
            )


def _settings_dict(saved: Any) -> dict[str, Any] | None:
    """Saved settings as a plain dict: ours and GPT-NeoX's are dicts, older Megatron runs pickled a Namespace."""
    if isinstance(saved, dict):
        return saved
    if hasattr(saved, "to_dict"):
        return dict(saved.to_dict())
    if saved is not None and hasattr(saved, "__dict__"):
        return dict(vars(saved))
    return None


def _settings_today(settings: dict[str, Any] | None, version: int | None) -> dict[str, Any] | None:
    """Settings of an older format of ours in today's meaning (see the format list above)."""
    if settings is None or version is None or version >= 2 or settings.get("intermediate_size") is None:
        return settings
    width = settings["intermediate_size"]  # per projection, as built: GPT-NeoX's rule builds it from these
    gated = settings.get("activation") in GATED_ACTIVATIONS
    return {**settings, "intermediate_size": 3 * width if gated else width, "mlp_multiple_of": 1}
