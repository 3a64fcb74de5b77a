"""`reward_function: "path/file.py:name"`: the user's scorer, called as TRL calls one,
name(prompts=[...], completions=[...], completion_ids=[...]) -> one number per completion. prompts[i] is the
text of completion i's prompt, completions[i] its text, both decoded without special tokens. Whatever keeps
it from giving one finite number per completion is one line naming the file and the function."""

from __future__ import annotations

import importlib.util
import math
import numbers
from pathlib import Path

from megatron.rollouts.errors import RolloutError


class RewardFunction:
    def __init__(self, spec: str):
        path, _, name = spec.rpartition(":")
        self.where = f"reward_function {spec!r}"
        if not Path(path).is_file():
            raise RolloutError(f"{self.where}: {path} is not a file; name a Python file and a function in it")
        module_spec = importlib.util.spec_from_file_location(f"reward_function_{Path(path).stem}", path)
        module = importlib.util.module_from_spec(module_spec)
        try:
            module_spec.loader.exec_module(module)
        except Exception as err:
            raise RolloutError(f"{self.where}: importing {path} raised {type(err).__name__}: {err}") from None
        self.function = getattr(module, name, None)
        if not callable(self.function):
            raise RolloutError(f"{self.where}: {path} has no function {name!r}")

    def __call__(self, prompts: list[str], completions: list[str], completion_ids: list[list[int]],
                 **token_ids) -> list[float]:
        try:
            rewards = self.function(prompts=prompts, completions=completions, completion_ids=completion_ids)
        except Exception as err:
            raise RolloutError(f"{self.where} raised {type(err).__name__}: {err}") from None
        if not hasattr(rewards, "__len__") or len(rewards) != len(completions):
            got = f"{len(rewards)} values" if hasattr(rewards, "__len__") else repr(type(rewards).__name__)
            raise RolloutError(f"{self.where} returned {got} for {len(completions)} completions; return one number "
                               "per completion")
        values = []
        for index, reward in enumerate(rewards):
            if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(reward):
                raise RolloutError(f"{self.where} returned {reward!r} for completion {index}; return a finite number "
                                   "for every completion")
            values.append(float(reward))
        return values
