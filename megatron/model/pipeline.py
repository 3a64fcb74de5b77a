"""The model as DeepSpeed's PipelineModule, for pipe_parallel_size > 1 (GPT-NeoX's GPT2ModelPipe layout).

The layer list has GPT-NeoX's positions, so DeepSpeed's pipe engine writes GPT-NeoX's layer files
(``layer_<II>-model_<MP>-model_states.pt``, II the position) and a layer's names inside its file are
those of ``GPTModel``'s ``sequential.<II>`` without that prefix:

    0                 EmbeddingPipe (tied to the output under the key "embed" when embeddings are tied)
    1                 parameterless: the embedding's output goes on
    2 .. L + 1        TransformerLayerPipe
    L + 2             parameterless: the hidden states alone go on
    L + 3             FinalNorm
    L + 4             OutputLayer, or the tied embedding's weight as the output projection

Between stages travels (hidden, position_ids[, attention_mask]); the last stage's loss takes
(labels, loss_mask). Each stage draws the weights of exactly the layers it holds from the same
stream of random numbers as ``build_model`` (the layers before its own are drawn and dropped), so
the model is the same function at every pipeline size. With LoRA adapters (megatron/model/lora.py) each
held transformer layer gets its adapters and the rest is frozen; ``build_model`` draws the adapters after
the whole base, so a stage then draws the whole base's stream before the adapters up to its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from megatron.architecture import Architecture
from megatron.lora_settings import LoraSettings
from megatron.model.embedding import Embedding
from megatron.model.gpt_model import FinalNorm, OutputLayer, _init_methods
from megatron.model.init_methods import initialise_parameters
from megatron.model.lora import add_layer_adapters, initialise_adapters
from megatron.model.loss import causal_lm_loss
from megatron.model.parallel_layers import copy_to_tensor_parallel_region
from megatron.model.rotary import RotaryEmbedding
from megatron.model.transformer_layer import TransformerLayer
from megatron.ranks import tensor_parallel_rank, tensor_parallel_size

TIED_EMBEDDING_KEY = "embed"  # GPT-NeoX's key of the tied embedding


class EmbeddingPipe(Embedding):
    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        tokens, position_ids, *mask = inputs
        return (super().forward(tokens, position_ids), position_ids, *mask)


class TransformerLayerPipe(TransformerLayer):
    """A transformer layer taking and returning the tuple that travels between stages."""

    def __init__(self, arch: Architecture, init_method, output_init_method):
        super().__init__(arch, init_method, output_init_method)
        self.recompute = arch.checkpoint_activations
        # no parameters and no persistent buffers: the layer's checkpoint names are TransformerLayer's
        self.rotary = (RotaryEmbedding(arch.rotary_ndims, arch.rotary_emb_base, arch.rope_scaling)
                       if arch.pos_emb == "rotary" else None)

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, position_ids, *mask = inputs
        cos_sin = self.rotary.cos_sin(position_ids, hidden.dtype) if self.rotary is not None else None
        attention_mask = mask[0] if mask else None
        if self.recompute and self.training and torch.is_grad_enabled():
            hidden = torch.utils.checkpoint.checkpoint(super().forward, hidden, cos_sin, attention_mask,
                                                       use_reentrant=False)
        else:
            hidden = super().forward(hidden, cos_sin, attention_mask)
        return (hidden, position_ids, *mask)


def _into_layers(inputs):
    return inputs


def _hidden_states_only(inputs):
    return inputs[0]


def _tied_output(embedding: EmbeddingPipe, hidden: torch.Tensor) -> torch.Tensor:
    """This rank's vocabulary slice of the logits, through the tied word embedding."""
    return F.linear(copy_to_tensor_parallel_region(hidden), embedding.word_embeddings.weight)


def _loss(logits: torch.Tensor, labels: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    targets, loss_mask = labels
    return causal_lm_loss(logits, targets, loss_mask, vocab_parallel=True)


def layer_specs(arch: Architecture) -> list:
    """GPT-NeoX's layer list (positions as in the module docstring)."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    init_method, output_init_method = _init_methods(arch)
    if arch.tied_embeddings:
        embedding = TiedLayerSpec(TIED_EMBEDDING_KEY, EmbeddingPipe, arch, init_method,
                                  tied_weight_attr="word_embeddings.weight")
        output = TiedLayerSpec(TIED_EMBEDDING_KEY, EmbeddingPipe, arch, init_method, forward_fn=_tied_output,
                               tied_weight_attr="word_embeddings.weight")
    else:
        embedding = LayerSpec(EmbeddingPipe, arch, init_method)
        output = LayerSpec(OutputLayer, arch, init_method)
    layers = [LayerSpec(TransformerLayerPipe, arch, init_method, output_init_method) for _ in range(arch.num_layers)]
    return [embedding, _into_layers, *layers, _hidden_states_only, LayerSpec(FinalNorm, arch), output]


def pipeline_topology(pipe_parallel_size: int):
    """DeepSpeed's (pipe, data, model) topology over megatron-core's groups, which must place the ranks alike."""
    import torch.distributed as dist
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    topology = PipeModelDataParallelTopology(num_pp=pipe_parallel_size, num_mp=tp,
                                             num_dp=dist.get_world_size() // (pipe_parallel_size * tp))
    rank = dist.get_rank()
    for axis, group in (("model", parallel_state.get_tensor_model_parallel_group()),
                        ("data", parallel_state.get_data_parallel_group()),
                        ("pipe", parallel_state.get_pipeline_model_parallel_group())):
        ranks = next(ranks for ranks in topology.get_axis_comm_lists(axis) if rank in ranks)
        if sorted(ranks) != sorted(dist.get_process_group_ranks(group)):
            raise RuntimeError(f"rank {rank}: DeepSpeed's {axis} group {ranks} is not megatron-core's "
                               f"{dist.get_process_group_ranks(group)}")
    return topology


def build_pipeline_model(arch: Architecture, seed: int, pipe_parallel_size: int, partition_method: str,
                         lora: LoraSettings | None = None):
    """This rank's stage of the model as a DeepSpeed PipelineModule, its weights those ``build_model(arch, seed,
    lora=lora)`` draws."""
    from deepspeed.pipe import PipelineModule

    specs = layer_specs(arch)
    module = PipelineModule(layers=specs, loss_fn=_loss, topology=pipeline_topology(pipe_parallel_size),
                            partition_method=partition_method, activation_checkpoint_interval=0)
    if lora is not None:
        module.requires_grad_(False)
        for position, spec in enumerate(specs):
            layer = local_layer(module, spec, position)
            if isinstance(layer, TransformerLayerPipe):
                add_layer_adapters(layer, arch, lora)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        _draw_stage_weights(module, specs, arch, lora)
    return module


def local_layer(module, spec, position: int) -> torch.nn.Module | None:
    """The module this stage holds at layer ``position`` (built from ``spec``), or None (another stage's, or
    parameterless, or the tied embedding's second use)."""
    from deepspeed.pipe import TiedLayerSpec

    if isinstance(spec, TiedLayerSpec):
        held = module.tied_modules[spec.key] if spec.key in module.tied_modules else None
        return held if spec.forward_fn is None else None
    return dict(module.named_children()).get(str(position))


def _draw_stage_weights(module, specs: list, arch: Architecture, lora: LoraSettings | None) -> None:
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    init_method, output_init_method = _init_methods(arch)
    own_end = module.parts[module.stage_id + 1]
    # The layers up to this stage's last, in build_model's order; the last stage holds the tied embedding
    # too, and draws it at position 0 like the first. Adapters come after the whole base in build_model.
    for position, spec in enumerate(specs[:own_end if lora is None else len(specs)]):
        if not isinstance(spec, LayerSpec) or (isinstance(spec, TiedLayerSpec) and spec.forward_fn is not None):
            continue
        layer = local_layer(module, spec, position)
        drawn = layer if layer is not None else spec.build()  # another stage's: drawn to keep the stream, dropped
        initialise_parameters(drawn, arch, init_method, output_init_method, tensor_parallel_rank(),
                              tensor_parallel_size())
    if lora is None:
        return
    for position, spec in enumerate(specs[:own_end]):
        if isinstance(spec, LayerSpec) and spec.typename is TransformerLayerPipe:
            layer = local_layer(module, spec, position)
            if layer is None:  # another stage's: its adapters drawn to keep the stream, dropped
                layer = spec.build()
                add_layer_adapters(layer, arch, lora)
            initialise_adapters(layer, arch)


def gpt_model_name(pipe_name: str) -> str:
    """The name ``GPTModel`` (and every checkpoint file of ours) gives the PipelineModule's parameter ``pipe_name``."""
    tied = f"tied_modules.{TIED_EMBEDDING_KEY}."
    return "sequential.0." + pipe_name.removeprefix(tied) if pipe_name.startswith(tied) else "sequential." + pipe_name


def stage_weights(module, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Of ``weights`` (named as ``GPTModel`` names them) those of this stage, under the PipelineModule's names."""
    return {name: weights[gpt_model_name(name)] for name in module.state_dict() if gpt_model_name(name) in weights}
