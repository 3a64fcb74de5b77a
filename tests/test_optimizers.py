import torch

from megatron.optimizers import build_param_groups


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(10, 4)
        self.linear = torch.nn.Linear(4, 4)
        self.norm = torch.nn.LayerNorm(4)
        self.frozen = torch.nn.Linear(4, 4, bias=False)
        self.frozen.weight.requires_grad_(False)


def test_biases_and_norm_weights_get_no_weight_decay():
    model = _Block()
    decay, no_decay = build_param_groups(model, weight_decay=0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert {names[id(p)] for p in decay["params"]} == {"embedding.weight", "linear.weight"}
    assert {names[id(p)] for p in no_decay["params"]} == {"linear.bias", "norm.weight", "norm.bias"}


def test_frozen_parameters_are_left_out():
    groups = build_param_groups(_Block(), weight_decay=0.1)
    assert all(p.requires_grad for g in groups for p in g["params"])
