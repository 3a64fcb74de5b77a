"""One rank of the 2-rank reward-model check; started by tests/distributed/test_reward_model.py.

    python -m torch.distributed.run --nproc_per_node 2 tests/distributed/reward_model_worker.py

For each family, at tensor-parallel sizes 2 and 1: the reward model's loss and full gradients on one batch
equal those of transformers' sequence classifier holding the same weights. Any failed comparison raises.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron.data import BatchOptions  # noqa: E402
from megatron.hf.mapping import convert_tensors, hf_to_ours, ours_to_hf  # noqa: E402
from megatron.model import build_model  # noqa: E402
from megatron.neox_arguments import NeoXArgs  # noqa: E402
from megatron.objectives import objective_for  # noqa: E402
from megatron.runtime.initialize import init_deepspeed_distributed, leave_process_group  # noqa: E402
from tests.distributed.tensor_parallel_worker import check, full, set_tensor_parallel_size  # noqa: E402
from tests.distributed.test_reward_model import RM, expected_loss, hf_config, hf_scores, pairs  # noqa: E402
from tests.unit.test_model import LLAMA, NEOX  # noqa: E402
from tests.unit.test_model_hf_equivalence import LAYERS  # noqa: E402
from tests.worker_report import report  # noqa: E402

BASE = dict(num_layers=LAYERS, hidden_size=64, num_attention_heads=4, seq_length=12, padded_vocab_size=128,
            hidden_dropout=0.0, attention_dropout=0.0, seed=77, z_loss=0.2, **RM)


def compare(family: str, tp: int) -> None:
    from transformers import GPTNeoXForSequenceClassification, LlamaForSequenceClassification

    set_tensor_parallel_size(tp)
    settings = {**BASE, **(NEOX if family == "gpt_neox" else LLAMA), "model_parallel_size": tp,
                "num_gpus": dist.get_world_size()}
    if family == "gpt_neox":
        settings.update(layernorm_epsilon=1e-5, rotary_emb_base=10000)
    args = NeoXArgs.from_dict(settings)
    model = build_model(args.architecture(), args.seed)
    samples, chats = pairs([(5, 8), (9, 3)])
    loss, _ = objective_for(args, BatchOptions())(model, samples)
    loss.backward()
    arch = model.arch
    weights = full({n: p.detach() for n, p in model.named_parameters()}, arch)
    grads = full({n: p.grad for n, p in model.named_parameters()}, arch)
    cls = GPTNeoXForSequenceClassification if family == "gpt_neox" else LlamaForSequenceClassification
    hf = cls(hf_config(family))
    hf.load_state_dict(convert_tensors(weights.items(), ours_to_hf(family, arch), "our weights"), strict=True)
    reference = expected_loss(hf_scores(hf, chats), 0.2)
    reference.backward()
    expected = convert_tensors(((n, p.grad) for n, p in hf.named_parameters()), hf_to_ours(family, arch),
                               "transformers' gradients")
    check(abs(loss.item() - reference.item()) <= 1e-5, f"{family} tp{tp}: loss {loss.item()}, "
          f"transformers' {reference.item()}")
    check(grads.keys() == expected.keys(), f"{family} tp{tp}: other parameters than transformers'")
    for name, grad in expected.items():
        check(torch.allclose(grads[name], grad, rtol=1e-4, atol=1e-5),
              f"{family} tp{tp}: gradient of {name} differs (max diff {(grads[name] - grad).abs().max()})")
    if dist.get_rank() == 0:
        report(case=f"{family} tp{tp}", ok=True, loss=loss.item())


def main() -> None:
    init_deepspeed_distributed(dist_backend="gloo")
    for family in ("gpt_neox", "llama"):
        for tp in (2, 1):
            compare(family, tp)


if __name__ == "__main__":
    main()
    leave_process_group()
