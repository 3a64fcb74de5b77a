"""REINFORCE's rollout parts on their own: advantages by their definitions, the reward function's failures in one
line, and GPT-NeoX's data-server protocol against a real TCP server on 127.0.0.1 (a thread), including one whose
reply would run code."""

from __future__ import annotations

import os
import pickle
import socket
import threading

import pytest
import torch

from megatron.rollouts.advantages import Advantages
from megatron.rollouts.data_server import ServerRollouts, request_groups, server_address
from megatron.rollouts.errors import RolloutError
from megatron.rollouts.reward_function import RewardFunction


def test_leave_one_out_subtracts_the_mean_of_the_other_completions():
    assert Advantages("leave_one_out").of_group([1.0, 2.0, 6.0]) == pytest.approx([1 - 4, 2 - 3.5, 6 - 1.5])


def test_group_normalized_is_trl_scaling_with_the_unbiased_std():
    rewards = [0.0, 1.0, 1.0, 4.0]  # mean 1.5, unbiased variance (2.25 + .25 + .25 + 6.25) / 3 = 3
    expected = [(r - 1.5) / (3 ** 0.5 + 1e-4) for r in rewards]
    assert Advantages("group_normalized").of_group(rewards) == pytest.approx(expected)
    assert Advantages("group_normalized").of_group([3.0]) == [0.0]


def test_moving_average_takes_the_baseline_before_the_group_joins_it_and_keeps_100_groups():
    advantages = Advantages("moving_average")
    assert advantages.of_group([1.0, 3.0]) == [1.0, 3.0]  # no groups yet: baseline 0
    assert advantages.of_group([0.0]) == [-2.0]  # baseline: the first group's mean
    for _ in range(100):
        advantages.of_group([5.0])
    assert advantages.of_group([5.0]) == [0.0]  # the first two groups fell out of the window


def reward_file(tmp_path, body: str) -> str:
    (tmp_path / "score.py").write_text(body)
    return f"{tmp_path / 'score.py'}:score"


@pytest.mark.parametrize("body, words", [
    ("def score(prompts, completions, **kw):\n    raise ValueError('boom')\n", "raised ValueError: boom"),
    ("def score(prompts, completions, **kw):\n    return [float('nan')] * len(completions)\n", "returned nan"),
    ("def score(prompts, completions, **kw):\n    return [1.0]\n", "returned 1 values for 2 completions"),
    ("def other():\n    pass\n", "has no function 'score'"),
])
def test_a_reward_function_that_cannot_score_is_one_line_naming_it(tmp_path, body, words):
    spec = reward_file(tmp_path, body)
    with pytest.raises(RolloutError) as refused:
        RewardFunction(spec)(prompts=["a", "a"], completions=["x", "y"], completion_ids=[[1], [2]])
    message = str(refused.value)
    assert words in message and spec in message and "\n" not in message


def test_the_reward_function_gets_trl_keywords(tmp_path):
    spec = reward_file(tmp_path, "def score(prompts, completions, completion_ids, **kw):\n"
                                 "    return [len(p) + len(c) + len(i) for p, c, i in zip(prompts, completions, "
                                 "completion_ids)]\n")
    assert RewardFunction(spec)(prompts=["ab"], completions=["c"], completion_ids=[[1, 2, 3]]) == [6.0]


class DataServer:
    """GPT-NeoX's protocol: read the split name, reply with a pickle, close. `replies` are sent in order."""

    def __init__(self, replies: list[bytes]):
        self.replies = list(replies)
        self.requests: list[str] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        for reply in self.replies:
            connection, _ = self.listener.accept()
            with connection:
                self.requests.append(connection.recv(4096).decode())
                connection.sendall(reply)
        self.listener.close()


GROUPS = [{"prefix": [5, 6, 7], "completions": [[8, 9], [10]], "rewards": [1.0, 3.0], "extra": "ignored"},
          {"prefix": [4], "completions": [[11, 12, 13], [14]], "rewards": [0.0, 0.5]}]


def test_the_data_server_client_speaks_gpt_neox_protocol_with_a_real_server():
    server = DataServer([pickle.dumps(GROUPS), pickle.dumps(GROUPS[:1])])
    rollouts = ServerRollouts("127.0.0.1", server.port, micro_batch_size=3, seq_length=5,
                              advantages=Advantages("leave_one_out"))
    first, second = next(rollouts), next(rollouts)  # 4 completions, then a second reply for the rest
    assert server.requests == ["train", "train"]
    assert first["text"].tolist() == [[5, 6, 7, 8, 9, 0], [5, 6, 7, 10, 0, 0], [4, 11, 12, 13, 0, 0]]
    assert first["label"].tolist() == [[-100, -100, -100, 8, 9, -100], [-100, -100, -100, 10, -100, -100],
                                       [-100, 11, 12, 13, -100, -100]]
    assert first["reward"].flatten().tolist() == [-2.0, 2.0, -0.5] and first["raw_reward"].flatten().tolist() == \
        [1.0, 3.0, 0.0]
    assert second["text"][0].tolist() == [4, 14, 0, 0, 0, 0] and second["reward"].flatten().tolist() == [0.5, -2.0, 2.0]


class RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_reply_whose_bytes_would_run_code_is_refused_in_one_line_and_nothing_runs(tmp_path):
    marker = tmp_path / "ran"
    assert pickle.loads(pickle.dumps(RunsCode(marker))) == 0 and marker.exists()  # what the full unpickler does
    marker.unlink()
    server = DataServer([pickle.dumps([{"prefix": [1], "completions": [[2]], "rewards": [RunsCode(marker)]}])])
    with pytest.raises(RolloutError) as refused:
        request_groups("127.0.0.1", server.port, "train")
    message = str(refused.value)
    assert "system" in message and "nothing of it ran" in message and "\n" not in message
    assert not marker.exists()


def test_a_reply_that_is_not_groups_and_an_unreachable_server_are_one_line():
    server = DataServer([pickle.dumps([{"prefix": [1], "completions": [[2]], "rewards": []}])])
    with pytest.raises(RolloutError, match="group 0 of its reply is not"):
        request_groups("127.0.0.1", server.port, "train")
    with socket.create_server(("127.0.0.1", 0)) as closed:
        port = closed.getsockname()[1]
    with pytest.raises(RolloutError, match=f"cannot read the data server at 127.0.0.1:{port}"):
        request_groups("127.0.0.1", port, "train")
    assert server_address("h", [1, 2], 1, 2) == ("h", 2) and server_address(["a", "b"], 7, 0, 2) == ("a", 7)
    with pytest.raises(RolloutError, match="2 entries for 3 data-parallel ranks"):
        server_address("h", [1, 2], 0, 3)


def test_the_rollout_samples_are_what_the_objective_reads():
    from megatron.data import get_batch
    from megatron.rollouts.scored_samples import ScoredCompletion, samples_of

    batch = get_batch(samples_of([ScoredCompletion([1, 2], [3, 4], 1.0, 0.5)], seq_length=5))
    assert batch.tokens.tolist() == [[1, 2, 3, 4, 0]] and batch.labels.tolist() == [[0, 3, 4, 0, 0]]
    assert torch.equal(batch.loss_mask, torch.tensor([[0.0, 1.0, 1.0, 0.0, 0.0]]))


def test_a_chat_sample_prompt_ends_before_its_first_trained_label():
    from megatron.rollouts.scored_samples import prompt_of

    text = torch.tensor([3, 8, 4, 9, 10, 5, 0, 0])
    label = torch.tensor([-100, -100, -100, 9, 10, 5, -100, -100])  # the preprocess tool's labels: the answer
    assert prompt_of(text, label) == [3, 8, 4]
    assert prompt_of(text, torch.full_like(label, -100)) is None
