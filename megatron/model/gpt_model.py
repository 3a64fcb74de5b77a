"""GPTModel: one decoder-only transformer covering the GPT-NeoX/Pythia and Llama families.

Submodules sit at GPT-NeoX's pipeline positions so that parameter names match GPT-NeoX
checkpoints one to one:

    sequential.0                 embedding (word_embeddings, position_embeddings)
    sequential.<i + 2>           transformer layer i
    sequential.<num_layers + 3>  final norm (``norm``)
    sequential.<num_layers + 4>  output layer (``final_linear``), absent with tied embeddings; for a
                                 reward model (train_impl rm) the scalar head ``rm_linear`` instead

(GPT-NeoX's positions 1 and num_layers + 2 hold parameterless functions; they have no module here.)
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from deepspeed.accelerator import get_accelerator

from megatron.contract.architecture import Architecture, ModelConfigError
from megatron.contract.lora_settings import LoraSettings
from megatron.model.context_parallel import ContextParallelSplit
from megatron.model.embedding import Embedding
from megatron.model.init_methods import init_std, initialise_parameters, normal_init
from megatron.model.kv_cache import KVCache
from megatron.model.lora import add_adapters, initialise_adapters
from megatron.model.moe import Routing
from megatron.model.norms import build_norm
from megatron.model.parallel_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    copy_to_tensor_parallel_region,
    gather_last_dim,
    model_parallel_config,
    split_last_dim,
    sum_gradient_over_sequence_parts,
)
from megatron.model.rotary import RotaryEmbedding
from megatron.model.sequence_parallel import gather_sequence, scatter_sequence
from megatron.model.transformer_layer import TransformerLayer
from megatron.ranks import tensor_parallel_rank, tensor_parallel_size


class FinalNorm(torch.nn.Module):
    """The final norm; with ``split`` it normalises this rank's part of the sequence and returns the whole
    sequence, gathered (the output layer, the tied embedding and the reward head sum their input's gradient over
    the tensor-parallel ranks, so the gather's backward keeps this rank's slice)."""

    def __init__(self, arch: Architecture):
        super().__init__()
        self.norm = build_norm(arch.norm, arch.hidden_size, arch.norm_epsilon, arch.bias_in_norms)
        if arch.splits_sequence:
            for param in self.norm.parameters():
                sum_gradient_over_sequence_parts(param)

    def forward(self, hidden: torch.Tensor, split: bool = False) -> torch.Tensor:
        normed = self.norm(hidden)
        return gather_sequence(normed, gradient_is_replicated=True) if split else normed


class OutputLayer(torch.nn.Module):
    def __init__(self, arch: Architecture, init_method):
        super().__init__()
        self.final_linear = ColumnParallelLinear(
            arch.hidden_size,
            arch.vocab_size,
            config=model_parallel_config(),
            init_method=init_method,
            bias=False,
            gather_output=False,
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary slice of the logits."""
        logits, _ = self.final_linear(hidden)
        return logits


class RewardHead(torch.nn.Module):
    """GPT-NeoX's reward-model head: a row-parallel hidden -> 1 projection without bias (each rank holds
    a slice of the hidden dimension; the partial sums are added over the tensor-parallel group)."""

    def __init__(self, arch: Architecture, init_method):
        super().__init__()
        self.rm_linear = RowParallelLinear(
            arch.hidden_size,
            1,
            config=model_parallel_config(),
            init_method=init_method,
            bias=False,
            input_is_parallel=True,  # split here: megatron-core's own split needs CUDA for its gradient
            skip_bias_add=False,
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[b, s, 1] rewards, the same on every tensor-parallel rank."""
        rewards, _ = self.rm_linear(split_last_dim(hidden))
        return rewards


def layer_key(index: int) -> str:
    """Key in ``sequential`` of transformer layer ``index`` (0-based)."""
    return str(index + 2)


def _init_methods(arch: Architecture):
    """(init method of most weights, init method of the output projections), as GPT-NeoX chooses them."""
    return tuple(normal_init(init_std(method, arch.init_method_std, arch.num_layers, arch.hidden_size))
                 for method in (arch.init_method, arch.output_layer_init_method))


class GPTModel(torch.nn.Module):
    """The decoder's structure; ``initialise_weights`` draws its weights (``build_model`` does both)."""

    def __init__(self, arch: Architecture, lora: LoraSettings | None = None):
        super().__init__()
        self.arch = arch
        init_method, output_init_method = _init_methods(arch)
        modules: dict[str, torch.nn.Module] = {"0": Embedding(arch, init_method)}
        for i in range(arch.num_layers):
            modules[layer_key(i)] = TransformerLayer(arch, init_method, output_init_method, experts=arch.has_experts(i))
        modules[str(arch.num_layers + 3)] = FinalNorm(arch)
        if arch.reward_head:
            if arch.tied_embeddings:
                raise ModelConfigError("a reward model's scalar head replaces the output layer, so it needs "
                                       "untied embeddings: set no_weight_tying: true (as GPT-NeoX requires)")
            modules[str(arch.num_layers + 4)] = RewardHead(arch, init_method)
        elif not arch.tied_embeddings:
            modules[str(arch.num_layers + 4)] = OutputLayer(arch, init_method)
        self.sequential = torch.nn.ModuleDict(modules)
        self.rotary = (
            RotaryEmbedding(arch.rotary_ndims, arch.rotary_emb_base, arch.rope_scaling) if arch.pos_emb == "rotary" else None
        )
        if lora is not None:
            add_adapters(self, lora)

    def initialise_weights(self) -> None:
        """Draw every weight from the current RNG state (init_methods.initialise_parameters)."""
        initialise_parameters(self, self.arch, *_init_methods(self.arch), tensor_parallel_rank(), tensor_parallel_size())
        initialise_adapters(self, self.arch)  # after the base: its draws are those of the same model without adapters

    @property
    def embedding(self) -> Embedding:
        return self.sequential["0"]

    @property
    def layers(self) -> list[TransformerLayer]:
        return [self.sequential[layer_key(i)] for i in range(self.arch.num_layers)]

    @property
    def reward_head(self) -> RewardHead:
        """A reward model's scalar head (train_impl rm), where a language model has its output layer."""
        return self.sequential[str(self.arch.num_layers + 4)]

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        parallel_output: bool = False,
        attention_mask: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        routing: list[Routing] | None = None,
    ) -> torch.Tensor:
        """input_ids [b, s] -> logits [b, s, padded_vocab_size] in the parameter dtype (a reward model:
        rewards [b, s, 1]).

        ``attention_mask`` [b, 1, s, s], True where a query may see a key, replaces the causal mask
        (megatron.data.batches builds one that also keeps packed documents apart).

        With ``parallel_output`` only this tensor-parallel rank's slice of the vocabulary (for
        ``causal_lm_loss(..., vocab_parallel=True)``, which never gathers the whole vocabulary).
        With ``kv_cache`` (generation) ``input_ids`` are the tokens after those already cached, at the
        positions after theirs; their keys and values are added to it.
        With ``routing`` (a list) each expert layer appends its router's logits and choices, in layer order,
        for the load-balancing loss and the experts' load (megatron/model/moe.py).
        With ``context_parallel_size`` > 1 the inputs are the whole sequence and the logits this rank's tokens'
        only, in ``ContextParallelSplit.own``'s order (megatron/model/context_parallel.py).
        """
        seq_len = input_ids.shape[1]
        past = kv_cache.length if kv_cache is not None else 0
        standard_positions = position_ids is None and not past
        if position_ids is None:
            max_positions = self.arch.max_position_embeddings
            if self.arch.pos_emb == "learned" and past + seq_len > max_positions:
                raise ModelConfigError(
                    f"sequence of {past + seq_len} tokens is longer than max_position_embeddings={max_positions} "
                    "of the learned position embedding; shorten the input or raise max_position_embeddings"
                )
            position_ids = torch.arange(past, past + seq_len, device=input_ids.device).unsqueeze(0)
        if self.arch.context_parallel_size > 1:
            input_ids, position_ids, attention_mask = self._context_parallel_share(
                input_ids, position_ids, attention_mask, kv_cache)
            standard_positions = False
        split = self._splits(seq_len, kv_cache)
        hidden = self.embedding(input_ids, position_ids)
        if split:
            hidden = scatter_sequence(hidden)
        rotary_cos_sin = None
        if self.rotary is not None and standard_positions:
            rotary_cos_sin = self.rotary.cos_sin_for_length(seq_len, hidden.device, hidden.dtype)
        elif self.rotary is not None:
            rotary_cos_sin = self.rotary.cos_sin(position_ids, hidden.dtype)
        recompute = self.arch.checkpoint_activations and self.training and torch.is_grad_enabled()
        for index, layer in enumerate(self.layers):
            if recompute:
                # the recomputation in the backward appends again, to a list whose loss is already taken
                hidden = torch.utils.checkpoint.checkpoint(layer, hidden, rotary_cos_sin, attention_mask, None,
                                                           routing, split, use_reentrant=False)
            else:
                hidden = layer(hidden, rotary_cos_sin, attention_mask,
                               kv_cache.layers[index] if kv_cache is not None else None, routing, split)
        hidden = self.sequential[str(self.arch.num_layers + 3)](hidden, split)
        if self.arch.reward_head:
            return self.reward_head(hidden)
        if self.arch.tied_embeddings:
            logits = F.linear(copy_to_tensor_parallel_region(hidden), self.embedding.word_embeddings.weight)
        else:
            logits = self.sequential[str(self.arch.num_layers + 4)](hidden)
        return logits if parallel_output else gather_last_dim(logits)

    def _context_parallel_share(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                                attention_mask: torch.Tensor | None, kv_cache: KVCache | None):
        """This context-parallel rank's inputs, their global positions and its queries' rows of the mask
        (megatron/model/context_parallel.py); the attention layers gather the keys and values."""
        seq_len = input_ids.shape[1]
        if kv_cache is not None or seq_len % (2 * self.arch.context_parallel_size):
            raise ModelConfigError(f"context_parallel_size {self.arch.context_parallel_size} splits whole sequences "
                                   f"of a multiple of {2 * self.arch.context_parallel_size} tokens, not {seq_len} "
                                   + ("with a key/value cache" if kv_cache is not None else "tokens") +
                                   "; generate and evaluate with context_parallel_size: 1")
        share = ContextParallelSplit.of_this_rank(seq_len, input_ids.device)
        return (share.own(input_ids), share.own(position_ids),
                share.query_mask(attention_mask, self.arch.sliding_window_width))

    def _splits(self, seq_len: int, kv_cache: KVCache | None) -> bool:
        """Whether this forward splits the sequence over the tensor-parallel ranks (sequence parallelism): always
        in training; a forward without gradients (generation's steps, any length) may run on the whole sequence."""
        if not self.arch.splits_sequence:
            return False
        shares_equally = seq_len % self.arch.model_parallel_size == 0
        if torch.is_grad_enabled() and (kv_cache is not None or not shares_equally):
            # the norms' gradient hooks sum over the ranks, which only the split sequence's parts need
            raise ModelConfigError(f"sequence_parallel splits each sequence over the {self.arch.model_parallel_size} "
                                   f"tensor-parallel ranks, and a sequence of {seq_len} tokens with gradients cannot "
                                   "be split equally; use a multiple of model_parallel_size")
        return kv_cache is None and shares_equally


def build_model(arch: Architecture, seed: int, partitioned_by=None, lora: LoraSettings | None = None) -> GPTModel:
    """GPTModel with weights drawn from ``seed`` (same seed, same weights), on the accelerator.

    With ``lora`` it has those LoRA adapters and only they train (megatron/model/lora.py).

    ``partitioned_by``, a ``deepspeed.zero.Init`` context, builds the model ZeRO-3-partitioned: each
    module's parameters are partitioned as soon as the module exists, so no rank holds the whole model,
    and the weights are then drawn one at a time, each rank keeping its partition. The weights are the
    same as without it. The global RNG state is left as it was.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with partitioned_by or contextlib.nullcontext():
            model = GPTModel(arch, lora)
        # Outside the context: inside it, DeepSpeed makes every new float tensor the training dtype,
        # and the draws must be fp32 to be the same for every precision.
        model.initialise_weights()
    return model if partitioned_by else model.to(get_accelerator().current_device_name())
