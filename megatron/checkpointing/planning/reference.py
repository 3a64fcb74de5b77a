"""The frozen reference model of DPO, KTO and REINFORCE (kl_div_beta > 0): which weights it is, decided with
the policy's load plan and recorded in every save, so a resumed run compares against exactly the model it started
from.

| the policy's load      | the reference                                                                   |
| `finetune: true`       | what `load` names (the tag the policy loads, or the Hugging Face folder)         |
| a resume of our save   | the source, tag and checksum that save recorded, read again and checked          |
| nothing (no `load`)    | refused: there is no model to compare against                                   |

GPT-NeoX loads its reference from `load` with the policy's flags, so a resumed DPO run compares the policy
with its own last checkpoint. Here a resume never takes the reference from the resumed policy: it reads the
recorded source and refuses in one line when that is gone or its weights changed (the identity and its
checksum: ondisk/identity.py; the check: plan.recorded_weights_plan, which a LoRA run's base shares).
"""

from __future__ import annotations

from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.formats.weights_source import WeightsSource
from megatron.checkpointing.ondisk.identity import ReferenceIdentity
from megatron.checkpointing.planning.load_settings import LoadSettings
from megatron.checkpointing.planning.plan import LoadMode, LoadPlan, recorded_weights_plan

TRAIN_IMPLS_WITH_REFERENCE = ("dpo", "kto")


def needs_reference(args) -> bool:
    """The objective compares the policy with a live frozen reference model."""
    if args.train_impl == "reinforce":
        return args.kl_div_beta > 0
    if args.train_impl not in TRAIN_IMPLS_WITH_REFERENCE:
        return False
    return not (args.precompute_model_name or (args.train_impl == "dpo" and args.dpo_reference_free))


def plan_reference(settings: LoadSettings, policy_plan: LoadPlan | None, data_parallel_size: int,
                   hf_source: WeightsSource | None = None) -> tuple[LoadPlan, ReferenceIdentity]:
    """The module-only plan that loads the reference model and the identity every save records;
    CheckpointError (one line) when there is no reference to load or the recorded one is gone or changed."""
    if policy_plan is None or policy_plan.nothing_to_load:
        raise CheckpointError(
            f"train_impl {settings.train_impl} compares the policy with the model it starts from, but "
            f"{'`load` is not set' if policy_plan is None else f'{policy_plan.load_dir} holds no checkpoint yet'}. "
            "Set `load` to the checkpoint or Hugging Face folder to start from, with `finetune: true`"
            + (", or set `dpo_reference_free: true`." if settings.train_impl == "dpo" else "."))
    if policy_plan.mode is LoadMode.FINETUNE:
        return policy_plan, ReferenceIdentity(str(policy_plan.load_dir), policy_plan.tag,
                                              policy_plan.weights_checksum)
    recorded = ReferenceIdentity.from_dict(policy_plan.client_state.reference_model, policy_plan.tag_dir)
    if recorded is None:
        raise CheckpointError(
            f"{policy_plan.tag_dir} records no reference model (saved by a run without a live one: another "
            "train_impl, dpo_reference_free or precompute_model_name; or by another program), so this resume cannot "
            f"know which model {settings.train_impl} compares against. Set `finetune: true` to start from its weights "
            "(they become the reference).")
    where = f"the reference model of this run, {recorded.path} (recorded in {policy_plan.tag_dir})"
    plan = recorded_weights_plan(settings, recorded, where, "A resume never takes the reference from the resumed policy: "
                                 "restore it at that path, or start a new run with `finetune: true`.",
                                 data_parallel_size, hf_source)
    return plan, recorded


def describe(identity: ReferenceIdentity, resumed: bool, adapters_off: bool = False) -> str:
    origin = "recorded by the checkpoint this run resumes" if resumed else "the model this fine-tune starts from"
    held = ("this run's own frozen base with its LoRA adapters switched off, no second model in memory"
            if adapters_off else "weights only, frozen")
    return f"reference model: {identity.path} ({origin}), {held}, checksum {identity.checksum}; recorded in every save"
