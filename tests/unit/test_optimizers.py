import pytest

from megatron.model import build_model
from megatron.optim.optimizers import build_param_groups
from tests.unit.test_model import LLAMA, tiny_args

pytestmark = pytest.mark.usefixtures("single_rank_world")


def _names(model, params):
    by_id = {id(p): name for name, p in model.named_parameters()}
    return {by_id[id(p)] for p in params}


@pytest.mark.parametrize("family", [{}, LLAMA], ids=["gpt-neox", "llama"])
def test_biases_and_norm_weights_get_no_weight_decay(family):
    model = build_model(tiny_args(family).architecture(), 1234)
    groups = build_param_groups(model, weight_decay=0.1)
    decayed = _names(model, groups[0]["params"])
    exempt = _names(model, groups[1]["params"]) if len(groups) > 1 else set()
    assert groups[0]["weight_decay"] == 0.1 and all(g["weight_decay"] == 0.0 for g in groups[1:])
    assert decayed | exempt == {name for name, _ in model.named_parameters()} and not decayed & exempt
    assert "sequential.0.word_embeddings.weight" in decayed
    assert "sequential.2.attention.query_key_value.weight" in decayed
    assert all(name.endswith((".bias", "norm.weight", "norm.scale", "layernorm.weight", "layernorm.scale"))
               for name in exempt), exempt
    norm_params = {n for n in decayed | exempt if "norm" in n}
    assert norm_params and norm_params <= exempt


def test_frozen_parameters_are_left_out():
    model = build_model(tiny_args().architecture(), 1234)
    model.get_parameter("sequential.0.word_embeddings.weight").requires_grad_(False)
    groups = build_param_groups(model, weight_decay=0.1)
    assert "sequential.0.word_embeddings.weight" not in _names(model, [p for g in groups for p in g["params"]])
