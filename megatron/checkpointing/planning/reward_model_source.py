"""The reward model scoring a REINFORCE run's completions (`reward_model`): a checkpoint a train_impl rm run saved,
loaded weights only as the DPO/KTO reference is (the same plan, checks and checksum), with the policy's
architecture under the scalar head and the policy's tokenizer. Its identity (identity.RewardModelIdentity) goes
into every save; a resume of such a save refuses in one line a reward model that is not the recorded one.

| the run                                   | the reward model                                                    |
| a fine-tune or a first run                | `reward_model`'s latest tag, which must be a reward model's         |
| a full resume of a save that recorded one | `reward_model`, which must be the recorded source, tag and checksum |
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.formats.weights_source import WeightsSource
from megatron.checkpointing.ondisk.identity import RewardModelIdentity
from megatron.checkpointing.ondisk.inventory import inventory_checkpoint
from megatron.checkpointing.planning.load_settings import LoadSettings
from megatron.checkpointing.planning.plan import LoadMode, LoadPlan, plan_for
from megatron.contract.architecture import Architecture


def plan_reward_model(settings: LoadSettings, path: str, architecture: Architecture, tokenizer_type: str | None,
                      policy_plan: LoadPlan | None, data_parallel_size: int,
                      hf_source: WeightsSource | None = None) -> tuple[LoadPlan, RewardModelIdentity]:
    """The module-only plan of the reward model at `path` (a model of `architecture`, the policy's with the
    reward head) and its identity; CheckpointError in one line when it is missing, not a reward model, of
    another tokenizer or shape, or not the one the resumed save recorded."""
    where = f"reward_model {path}"
    if not Path(path).exists():
        raise CheckpointError(f"{where} does not exist; name the `save` directory of a train_impl rm run")
    rm_settings = dataclasses.replace(
        settings.weights_only(where, load=path), train_impl="rm", lora_rank=0, lora=None, load_module_strict=True,
        load_module_allow_random=(), checkpoint_validation_with_forward_pass=False,
        architecture=lambda: architecture, architecture_fields={**settings.architecture_fields, "reward_head": True})
    try:
        plan = plan_for(rm_settings, inventory_checkpoint(path, hf_source), data_parallel_size, hf_source)
    except CheckpointError as err:
        raise CheckpointError(f"{where} cannot score this run's completions: {err}") from None
    saved = plan.client_state.settings or {}
    if plan.fresh_reward_head:
        raise CheckpointError(f"{where} is not a reward model (its tag {plan.tag or plan.load_dir} was saved by "
                              f"train_impl {saved.get('train_impl')!r}, it has no scalar head); name a checkpoint "
                              "saved by a train_impl rm run")
    if tokenizer_type and saved.get("tokenizer_type") not in (None, tokenizer_type):
        raise CheckpointError(f"{where} was trained with tokenizer_type {saved['tokenizer_type']}, this run's policy "
                              f"uses {tokenizer_type}: it would read other tokens; train the reward model with the "
                              "policy's tokenizer")
    identity = RewardModelIdentity(str(plan.load_dir), plan.tag, plan.weights_checksum)
    recorded = _recorded(policy_plan)
    if recorded is not None and recorded != identity:
        raise CheckpointError(
            f"{policy_plan.tag_dir} was trained with the reward model {recorded.path} (checksum {recorded.checksum}), "
            f"but reward_model is now {identity.path} (checksum {identity.checksum}): a resume scores with the same "
            "reward model; restore it, or start a new run from the tag with `finetune: true`")
    return plan, identity


def _recorded(policy_plan: LoadPlan | None) -> RewardModelIdentity | None:
    """The reward model a fully resumed save recorded (None for any other load)."""
    if policy_plan is None or policy_plan.mode is not LoadMode.RESUME:
        return None
    return RewardModelIdentity.from_dict(policy_plan.client_state.reward_model, policy_plan.tag_dir)


def describe(identity: RewardModelIdentity) -> str:
    return (f"reward model: {identity.path}, weights only, frozen, checksum {identity.checksum}; scores every "
            "completion, recorded in every save")
