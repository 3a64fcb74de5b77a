"""The router-collapse watch (megatron/objectives/expert_load.py) over steps of expert loads: when it speaks, and once."""

from __future__ import annotations

import pytest

from megatron.neox_arguments import ConfigError, NeoXArgs
from megatron.objectives.expert_load import ExpertLoadWatch, expert_load_name
from tests.ckpt_engines import ARCHITECTURE


def watch(**overrides) -> ExpertLoadWatch:
    values = dict(ARCHITECTURE, num_layers=4, moe_num_experts=4, moe_router_type="topk", moe_expert_interval=2, use_bias_in_mlp=False,
                  moe_collapse_steps=3)
    return ExpertLoadWatch(NeoXArgs.from_dict({**values, **overrides}))


def loads(layer_2_shares: list[float]) -> dict[str, float]:
    """Layer 0 evenly spread, layer 2 as given."""
    even = {expert_load_name(0, expert): 0.25 for expert in range(4)}
    return {**even, **{expert_load_name(2, expert): share for expert, share in enumerate(layer_2_shares)}}


COLLAPSED_ON_1 = [0.02, 0.95, 0.02, 0.01]
COLLAPSED_ON_3 = [0.02, 0.01, 0.02, 0.95]
SPREAD = [0.4, 0.3, 0.2, 0.1]


def test_a_collapse_is_reported_once_per_stretch_of_steps_on_one_expert():
    expert_loads = watch()
    steps = [COLLAPSED_ON_1, COLLAPSED_ON_1, COLLAPSED_ON_3,  # the expert changes: the count starts again
             COLLAPSED_ON_3, COLLAPSED_ON_3, COLLAPSED_ON_3, COLLAPSED_ON_3,  # said at the third, not again
             SPREAD, COLLAPSED_ON_3, COLLAPSED_ON_3, COLLAPSED_ON_3]  # a new stretch after a spread step
    said = {step: expert_loads.after_step(step, loads(shares)) for step, shares in enumerate(steps, start=1)}
    assert {step: lines for step, lines in said.items() if lines} == {
        5: ["router collapse: layer 2 sent 95% of its tokens to expert 3 in each of the 3 steps to 5 "
            "(moe_collapse_token_share 0.9, moe_collapse_steps 3); its other experts hardly train: "
            "moe_load_balancing_loss adds a loss against it"],
        11: [said[5][0].replace("to 5 ", "to 11 ")]}
    assert expert_loads.scalars(loads(COLLAPSED_ON_1)) == {"train/max_expert_load": 0.95}


def test_the_share_counts_tokens_not_slots_and_top_k_of_every_expert_has_nothing_to_collapse():
    top_2 = watch(moe_top_k=2, moe_collapse_steps=1)
    assert top_2.after_step(1, loads([0.46, 0.44, 0.05, 0.05]))  # 92% of the tokens pick expert 0
    assert not top_2.after_step(2, loads([0.44, 0.44, 0.06, 0.06]))
    everyone = watch(moe_top_k=4, moe_collapse_steps=1)
    assert not everyone.after_step(1, loads([0.25, 0.25, 0.25, 0.25]))


@pytest.mark.parametrize(("name", "value"), [("moe_collapse_token_share", 0.0), ("moe_collapse_token_share", 1.5),
                                             ("moe_collapse_steps", 0)])
def test_a_collapse_setting_out_of_range_is_refused_in_one_line(name, value):
    with pytest.raises(ConfigError, match=name) as error:
        watch(**{name: value})
    assert "\n" not in str(error.value)
