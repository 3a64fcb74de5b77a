"""One rank of the 2-rank ZeRO-3 construction test; started by tests/distributed/test_zero3_construction.py.

    python -m torch.distributed.run --nproc_per_node 2 tests/distributed/zero3_construction_worker.py

A model built under ``deepspeed.zero.Init`` must hold only its partition on each rank from the moment
it exists, and its weights, gathered, must be the ones a plain whole build draws from the same seed
(in every precision, and at tensor-parallel size 2, where each rank builds only its shard). Any failed
comparison raises, so a non-zero exit fails the test.
"""

from __future__ import annotations

import logging
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from deepspeed.utils import logger as deepspeed_logger  # noqa: E402
from megatron.core import parallel_state  # noqa: E402

from megatron.model import build_model, causal_lm_loss  # noqa: E402
from megatron.neox_arguments import NeoXArgs  # noqa: E402
from megatron.runtime.initialize import init_deepspeed_distributed, leave_process_group, zero3_construction  # noqa: E402
from tests.distributed.tensor_parallel_worker import check, set_tensor_parallel_size  # noqa: E402
from tests.worker_report import report  # noqa: E402

VOCAB = 96
SEQ = 10
SEED = 31
FAMILIES = {
    # GPT-2 style: learned positions (drawn like every other weight), tied embeddings, biases.
    "tied-learned": dict(pos_emb="learned", gpt_j_residual=False, no_weight_tying=False, norm="layernorm",
                         activation="gelu", intermediate_size=64),
    # Llama: RMSNorm, SwiGLU, grouped-query attention, untied output.
    "llama": dict(pos_emb="rotary", rotary_pct=1.0, gpt_j_residual=False, no_weight_tying=True, norm="rmsnorm",
                  activation="swiglu", intermediate_size=3 * 80, num_kv_heads=2, use_bias_in_norms=False,
                  use_bias_in_attn_linear=False, use_bias_in_mlp=False),
    # One key/value head: at tensor-parallel size 2 both ranks hold it (replicated, not split).
    "llama-mqa": dict(pos_emb="rotary", rotary_pct=1.0, gpt_j_residual=False, no_weight_tying=True, norm="rmsnorm",
                      activation="swiglu", intermediate_size=3 * 80, num_kv_heads=1, use_bias_in_norms=False,
                      use_bias_in_attn_linear=False, use_bias_in_mlp=False),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def arch(family: str, tp: int):
    return NeoXArgs.from_dict(dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=SEQ,
                                   padded_vocab_size=VOCAB, hidden_dropout=0.0, attention_dropout=0.0,
                                   model_parallel_size=tp, num_gpus=dist.get_world_size(),
                                   **FAMILIES[family])).architecture()


def ds_config(precision: str) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            "bf16": {"enabled": precision == "bf16"},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


def partitioned_build(family: str, tp: int, precision: str):
    return build_model(arch(family, tp), SEED, partitioned_by=zero3_construction(ds_config(precision)))


def check_construction(family: str, tp: int, precision: str) -> None:
    """Only partitions on this rank; gathered, the weights of a whole build from the same seed."""
    model = partitioned_build(family, tp, precision)
    whole = dict(build_model(arch(family, tp), SEED).named_parameters())
    group_size = dist.get_world_size(parallel_state.get_data_parallel_group())
    held = 0
    for name, param in model.named_parameters():
        check(hasattr(param, "ds_id"), f"{name} was not built partitioned")
        check(param.data.numel() == 0, f"{name} holds {param.data.numel()} elements outside its partition")
        check(param.ds_tensor.numel() == math.ceil(param.ds_numel / group_size),
              f"{name}: partition of {param.ds_tensor.numel()} elements for {param.ds_numel} over {group_size} ranks")
        check(param.ds_tensor.dtype == DTYPES[precision], f"{name} partition is {param.ds_tensor.dtype}")
        held += param.ds_tensor.numel()
        with deepspeed.zero.GatheredParameters([param]):
            check(torch.equal(param.data, whole[name].detach().to(DTYPES[precision])),
                  f"{family} tp{tp} {precision}: {name} differs from the whole build's")
    whole_numel = sum(p.numel() for p in whole.values())
    if dist.get_rank() == 0:
        report(case=f"{family} tp{tp} {precision}", partition_elements=held, whole_elements=whole_numel)


def check_training_forward(family: str) -> None:
    """A ZeRO-3 engine on the partitioned build gives the whole model's loss (fp32, same batch)."""
    model = partitioned_build(family, 1, "fp32")
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config("fp32"))
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(5))
    loss = causal_lm_loss(engine(tokens[:, :-1]), tokens[:, 1:], torch.ones(2, SEQ))
    reference = build_model(arch(family, 1), SEED)
    expected = causal_lm_loss(reference(tokens[:, :-1]), tokens[:, 1:], torch.ones(2, SEQ))
    check(torch.allclose(loss, expected, rtol=0, atol=1e-6), f"{family}: engine loss {loss} vs whole model {expected}")
    engine.backward(loss)
    engine.step()
    if dist.get_rank() == 0:
        report(case=f"{family} engine", loss=loss.item())


def main() -> None:
    deepspeed_logger.setLevel(logging.WARNING)
    init_deepspeed_distributed(dist_backend="gloo")
    for tp in (1, 2):
        set_tensor_parallel_size(tp)
        for family in FAMILIES:
            for precision in DTYPES:
                check_construction(family, tp, precision)
    set_tensor_parallel_size(1)
    for family in FAMILIES:
        check_training_forward(family)
    report(check="zero3 construction", ok=True)


if __name__ == "__main__":
    main()
    leave_process_group()
