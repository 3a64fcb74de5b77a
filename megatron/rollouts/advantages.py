"""A completion's advantage from the rewards of its prompt's completions (its group), as `reinforce_advantage` names:

- moving_average (GPT-NeoX's reinforce_leave_one_out: false): r_i minus the mean of the last 100 groups' mean
  rewards, taken before this group's mean joins them (0 for the first group);
- leave_one_out (reinforce_leave_one_out: true, RLOO): r_i minus the mean of the group's other rewards;
- group_normalized (GRPO, TRL's default scaling): (r_i - mean) / (std + 1e-4), std unbiased (n - 1), 0 for a
  group of one.
"""

from __future__ import annotations

from collections import deque

import torch

from megatron.rollouts.errors import RolloutError

MOVING_AVERAGE_GROUPS = 100  # GPT-NeoX's window
GROUP_STD_EPSILON = 1e-4  # TRL's


def advantage_mode(reinforce_advantage: str | None, reinforce_leave_one_out: bool) -> str:
    return reinforce_advantage or ("leave_one_out" if reinforce_leave_one_out else "moving_average")


class Advantages:
    """The advantages of one rank's groups, in the order they come (the moving average remembers them)."""

    def __init__(self, mode: str):
        self.mode = mode
        self.recent_means: deque[float] = deque(maxlen=MOVING_AVERAGE_GROUPS)

    def of_group(self, rewards: list[float]) -> list[float]:
        values = torch.tensor(rewards, dtype=torch.float64)
        if self.mode == "leave_one_out":
            if len(rewards) < 2:
                raise RolloutError("reinforce_leave_one_out: a prompt came with 1 completion, which has no other "
                                   "completions to compare with; send 2 or more per prompt")
            return (values - (values.sum() - values) / (len(rewards) - 1)).tolist()
        if self.mode == "group_normalized":
            if len(rewards) < 2:
                return [0.0] * len(rewards)
            return ((values - values.mean()) / (values.std(unbiased=True) + GROUP_STD_EPSILON)).tolist()
        baseline = sum(self.recent_means) / len(self.recent_means) if self.recent_means else 0.0
        self.recent_means.append(float(values.mean()))
        return (values - baseline).tolist()

    def state_dict(self) -> dict:
        return {"mode": self.mode, "recent_means": list(self.recent_means)}

    def load_state_dict(self, state: dict) -> None:
        self.recent_means = deque(state["recent_means"], maxlen=MOVING_AVERAGE_GROUPS)
