"""GPT-NeoX's online data server, as its client (dataset_impl online, no reward_function).

Protocol (GPT-NeoX's megatron/data/online_dataset.py): for every refill a new TCP connection to the data-parallel
rank's server (online_dataserver_ips / ports: one value for every rank, or a list indexed by data-parallel rank);
the client sends the split name ("train") as bare UTF-8 bytes; the server replies with a pickle of a list of
groups, {"prefix": [token ids], "completions": [[token ids], ...], "rewards": [one number per completion]}, and
closes the connection. Only tensor-parallel rank 0 of each model-parallel group asks; it hands the groups (or its
one-line error) to the group's other ranks, as GPT-NeoX broadcasts the batch. The reply is decoded by a decoder that builds lists, dicts, numbers and strings only
(megatron/checkpointing/ondisk/safe_unpickle.plain_values): a reply naming any class or function is refused in
one line, unbuilt, so nothing of it runs. Samples come out group by group, completion by completion, the
micro batch train_micro_batch_size_per_gpu completions, as in GPT-NeoX.
"""

from __future__ import annotations

import pickle
import socket
from collections import deque
from collections.abc import Iterator

import torch

from megatron.checkpointing import plain_values
from megatron.rollouts.advantages import Advantages
from megatron.rollouts.errors import RolloutError
from megatron.rollouts.scored_samples import ScoredCompletion, samples_of


def server_address(ips, ports, data_parallel_rank: int, data_parallel_size: int) -> tuple[str, int]:
    for name, value in (("online_dataserver_ips", ips), ("online_dataserver_ports", ports)):
        if isinstance(value, list) and len(value) != data_parallel_size:
            raise RolloutError(f"{name}: {len(value)} entries for {data_parallel_size} data-parallel ranks; give one "
                               "per data-parallel rank, or one value for all")
    return (ips[data_parallel_rank] if isinstance(ips, list) else ips,
            ports[data_parallel_rank] if isinstance(ports, list) else ports)


def request_groups(host: str, port: int, split: str) -> list[dict]:
    """One reply of the data server at host:port: its groups, checked."""
    where = f"the data server at {host}:{port}"
    try:
        with socket.create_connection((host, port)) as connection:
            connection.sendall(split.encode("utf-8"))
            chunks = []
            while chunk := connection.recv(1 << 16):
                chunks.append(chunk)
    except OSError as err:
        raise RolloutError(f"cannot read {where} ({err}); start it, or set online_dataserver_ips / "
                           "online_dataserver_ports to where it listens") from None
    try:
        reply = plain_values(b"".join(chunks))
    except pickle.UnpicklingError as err:
        raise RolloutError(f"{where} replied with {err}, which decoding would have to build or run; refused, "
                           "nothing of it ran: a reply holds lists, dicts, numbers and strings only") from None
    except Exception as err:  # a truncated or garbled stream
        raise RolloutError(f"{where} replied with bytes that are not a pickle ({type(err).__name__}: {err})") from None
    return _checked_groups(reply, where)


def _checked_groups(reply, where: str) -> list[dict]:
    if not isinstance(reply, list) or not reply:
        raise RolloutError(f"{where} replied with {type(reply).__name__}, not a non-empty list of groups")
    for index, group in enumerate(reply):
        ok = (isinstance(group, dict) and _token_list(group.get("prefix"))
              and isinstance(group.get("completions"), list) and all(map(_token_list, group["completions"]))
              and isinstance(group.get("rewards"), list) and len(group["rewards"]) == len(group["completions"])
              and all(isinstance(r, int | float) and not isinstance(r, bool) for r in group["rewards"]))
        if not ok:
            raise RolloutError(f"{where}: group {index} of its reply is not {{'prefix': [token ids], 'completions': "
                               "[[token ids], ...], 'rewards': [one number per completion]}")
    return reply


def from_tensor_parallel_rank_zero(fetch):
    """`fetch()` run on tensor-parallel rank 0 alone, its result (or its RolloutError) the same on every rank of
    the group."""
    import torch.distributed as dist

    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized() or parallel_state.get_tensor_model_parallel_world_size() == 1:
        return fetch()
    payload: list = [None]
    if parallel_state.get_tensor_model_parallel_rank() == 0:
        try:
            payload = [("groups", fetch())]
        except RolloutError as err:
            payload = [("error", str(err))]
    dist.broadcast_object_list(payload, src=parallel_state.get_tensor_model_parallel_src_rank(),
                               group=parallel_state.get_tensor_model_parallel_group())
    kind, value = payload[0]
    if kind == "error":
        raise RolloutError(value)
    return value


def _token_list(value) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)


class ServerRollouts(Iterator):
    def __init__(self, host: str, port: int, micro_batch_size: int, seq_length: int, advantages: Advantages,
                 split: str = "train"):
        self.host, self.port, self.split = host, port, split
        self.micro_batch_size = micro_batch_size
        self.seq_length = seq_length
        self.advantages = advantages
        self.waiting: deque[ScoredCompletion] = deque()

    def state_dict(self) -> dict:
        """The moving-average baseline (the server's completions are not saved: it sends new ones)."""
        return {"advantages": self.advantages.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.advantages.load_state_dict(state["advantages"])

    def __next__(self) -> dict[str, torch.Tensor]:
        rows = []
        while len(rows) < self.micro_batch_size:
            if not self.waiting:
                self._refill()
            rows.append(self.waiting.popleft())
        return samples_of(rows, self.seq_length)

    def _refill(self) -> None:
        for group in from_tensor_parallel_rank_zero(lambda: request_groups(self.host, self.port, self.split)):
            rewards = [float(r) for r in group["rewards"]]
            for completion, reward, advantage in zip(group["completions"], rewards, self.advantages.of_group(rewards),
                                                     strict=True):
                self.waiting.append(ScoredCompletion(group["prefix"], completion, reward, advantage))
