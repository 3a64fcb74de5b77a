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

Between stages travels (hidden, position_ids[, attention_mask][, router statistics]), after the layers
(hidden[, router statistics]); the last stage's loss takes (labels, loss_mask). With experts the router
statistics ([2 + expert layers, experts], fp32) carry what the routers of the layers so far did: rows 0-1 their
``load_balancing_sums`` added up, row 2 + j the router's choices counted for the j-th expert layer. So the last
stage computes the load-balancing loss over every expert layer, as one module does (its gradient goes back to
every stage's routers with the statistics'), and the expert load of every layer, whichever stage holds it.
With sequence parallelism the hidden states travel as each tensor-parallel rank's part of the sequence (split
after the embedding, gathered by the final norm), to the next stage's rank of the same tensor-parallel rank.
Each stage draws the weights of exactly the layers it holds from the same
stream of random numbers as ``build_model`` (the layers before its own are drawn and dropped), so
the model is the same function at every pipeline size. With LoRA adapters (megatron/model/lora.py) each
held transformer layer gets its adapters and the rest is frozen; ``build_model`` draws the adapters after
the whole base, so a stage then draws the whole base's stream before the adapters up to its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from megatron.contract.architecture import Architecture
from megatron.contract.lora_settings import LoraSettings
from megatron.model.embedding import Embedding
from megatron.model.gpt_model import FinalNorm, OutputLayer, _init_methods
from megatron.model.init_methods import initialise_parameters
from megatron.model.lora import add_layer_adapters, initialise_adapters
from megatron.model.loss import causal_lm_loss
from megatron.model.moe import Routing, load_balancing_loss_of_sums, load_balancing_sums
from megatron.model.parallel_layers import copy_to_tensor_parallel_region
from megatron.model.rotary import RotaryEmbedding
from megatron.model.sequence_parallel import scatter_sequence
from megatron.model.transformer_layer import TransformerLayer
from megatron.ranks import tensor_parallel_rank, tensor_parallel_size

TIED_EMBEDDING_KEY = "embed"  # GPT-NeoX's key of the tied embedding


def statistics_rows(arch: Architecture) -> int:
    """Rows of the router statistics: the two load-balancing sums and one count per expert layer."""
    return 2 + sum(arch.has_experts(layer) for layer in range(arch.num_layers))


def _unpack(inputs: tuple[torch.Tensor, ...], experts: bool):
    """(hidden, position_ids, the attention mask or None, the router statistics or None) of what travels."""
    hidden, position_ids, *rest = inputs
    statistics = rest.pop() if experts else None
    return hidden, position_ids, rest[0] if rest else None, statistics


def _pack(hidden, position_ids, attention_mask, statistics) -> tuple[torch.Tensor, ...]:
    return tuple(t for t in (hidden, position_ids, attention_mask, statistics) if t is not None)


class EmbeddingPipe(Embedding):
    def __init__(self, arch: Architecture, init_method):
        super().__init__(arch, init_method)
        self.statistics_shape = (statistics_rows(arch), arch.moe_num_experts) if arch.moe else None
        self.split = arch.splits_sequence

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        tokens, position_ids, *mask = inputs
        hidden = super().forward(tokens, position_ids)
        if self.split:
            hidden = scatter_sequence(hidden)
        statistics = None
        if self.statistics_shape is not None:
            # requires a gradient even where this stage holds no expert layer: DeepSpeed's pipe engine runs the
            # backward of every floating-point tensor a stage sends
            statistics = torch.zeros(self.statistics_shape, dtype=torch.float32, device=hidden.device,
                                     requires_grad=torch.is_grad_enabled())
        return _pack(hidden, position_ids, mask[0] if mask else None, statistics)


class TransformerLayerPipe(TransformerLayer):
    """A transformer layer (layer ``layer`` from 0) taking and returning the tuple that travels between stages."""

    def __init__(self, arch: Architecture, init_method, output_init_method, layer: int):
        super().__init__(arch, init_method, output_init_method, experts=arch.has_experts(layer))
        self.recompute = arch.checkpoint_activations
        self.split = arch.splits_sequence
        # no parameters and no persistent buffers: the layer's checkpoint names are TransformerLayer's
        self.rotary = (RotaryEmbedding(arch.rotary_ndims, arch.rotary_emb_base, arch.rope_scaling)
                       if arch.pos_emb == "rotary" else None)
        self.carries_statistics = arch.moe
        self.num_experts, self.top_k = arch.moe_num_experts, arch.moe_top_k
        # this layer's count row in the router statistics, when it has experts
        self.statistics_row = 2 + sum(arch.has_experts(i) for i in range(layer)) if arch.has_experts(layer) else None

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, position_ids, attention_mask, statistics = _unpack(inputs, self.carries_statistics)
        cos_sin = self.rotary.cos_sin(position_ids, hidden.dtype) if self.rotary is not None else None
        if self.recompute and self.training and torch.is_grad_enabled():
            hidden, statistics = torch.utils.checkpoint.checkpoint(self._layer, hidden, cos_sin, attention_mask,
                                                                   statistics, use_reentrant=False)
        else:
            hidden, statistics = self._layer(hidden, cos_sin, attention_mask, statistics)
        return _pack(hidden, position_ids, attention_mask, statistics)

    def _layer(self, hidden, cos_sin, attention_mask, statistics):
        routing: list[Routing] = []
        hidden = super().forward(hidden, cos_sin, attention_mask, routing=routing, split=self.split)
        if self.statistics_row is None:
            return hidden, statistics
        record, = routing
        counts = torch.bincount(record.chosen.reshape(-1), minlength=self.num_experts).float()
        before, after = self.statistics_row - 2, statistics.shape[0] - self.statistics_row - 1
        update = torch.cat([load_balancing_sums(record.logits, self.num_experts, self.top_k),
                            counts.new_zeros(before, self.num_experts), counts[None],
                            counts.new_zeros(after, self.num_experts)])
        return hidden, statistics + update


def _into_layers(inputs):
    return inputs


def _hidden_states_only(inputs):
    return (inputs[0],)  # a tuple: the layers after take and return (hidden[, router statistics])


def _hidden_states_and_statistics(inputs):
    return (inputs[0], inputs[-1])


class FinalNormPipe(FinalNorm):
    def __init__(self, arch: Architecture):
        super().__init__(arch)
        self.split = arch.splits_sequence

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, *statistics = inputs
        return (super().forward(hidden, self.split), *statistics)


class OutputLayerPipe(OutputLayer):
    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, *statistics = inputs
        return (super().forward(hidden), *statistics)


def _tied_output(embedding: EmbeddingPipe, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """This rank's vocabulary slice of the logits, through the tied word embedding."""
    hidden, *statistics = inputs
    return (F.linear(copy_to_tensor_parallel_region(hidden), embedding.word_embeddings.weight), *statistics)


class PipelineLoss:
    """The last stage's loss of a micro batch: the language-model loss, with experts plus
    moe_load_balancing_loss_coef x the load-balancing loss over every expert layer (as
    objectives/language_model.py adds it). With experts it keeps each micro batch's (language-model loss, router
    statistics, tokens) in ``kept`` for the step's metrics (megatron/training/pipe_engine.py takes them)."""

    def __init__(self, arch: Architecture):
        self.arch = arch
        self.kept: list[tuple[torch.Tensor, torch.Tensor, int]] = []

    def __call__(self, outputs: tuple[torch.Tensor, ...], labels: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        logits, *statistics = outputs
        targets, loss_mask = labels
        lm_loss = causal_lm_loss(logits, targets, loss_mask, vocab_parallel=True)
        if not statistics:
            return lm_loss
        tokens = targets.numel()
        self.kept.append((lm_loss.detach(), statistics[0].detach(), tokens))
        balance = pipeline_load_balancing_loss(statistics[0], tokens, self.arch)
        # Added with coefficient 0 when the loss leaves it out, so that the statistics get their gradient:
        # DeepSpeed's pipe engine sends one back for every floating-point tensor a stage received.
        coef = self.arch.moe_load_balancing_loss_coef if self.arch.moe_load_balancing_loss else 0.0
        return lm_loss + coef * balance


def pipeline_load_balancing_loss(statistics: torch.Tensor, tokens: int, arch: Architecture) -> torch.Tensor:
    """``moe.load_balancing_loss`` of a micro batch of ``tokens`` tokens from its router statistics."""
    return load_balancing_loss_of_sums(statistics[:2], tokens * (statistics.shape[0] - 2), arch.moe_num_experts)


def pipeline_expert_loads(statistics: torch.Tensor, tokens: int, arch: Architecture) -> list[torch.Tensor]:
    """``moe.expert_load`` of each expert layer, in layer order, from a micro batch's router statistics."""
    return [counts / (tokens * arch.moe_top_k) for counts in statistics[2:]]


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
        output = LayerSpec(OutputLayerPipe, arch, init_method)
    layers = [LayerSpec(TransformerLayerPipe, arch, init_method, output_init_method, layer)
              for layer in range(arch.num_layers)]
    after_layers = _hidden_states_and_statistics if arch.moe else _hidden_states_only
    return [embedding, _into_layers, *layers, after_layers, LayerSpec(FinalNormPipe, arch), output]


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
    module = PipelineModule(layers=specs, loss_fn=PipelineLoss(arch), topology=pipeline_topology(pipe_parallel_size),
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
