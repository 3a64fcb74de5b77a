"""The input embedding: word embeddings plus, for pos_emb=learned, learned position embeddings."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.contract.architecture import Architecture
from megatron.model.parallel_layers import VocabParallelEmbedding, model_parallel_config


class Embedding(torch.nn.Module):
    def __init__(self, arch: Architecture, init_method):
        super().__init__()
        self.hidden_dropout = arch.hidden_dropout
        self.word_embeddings = VocabParallelEmbedding(
            arch.vocab_size, arch.hidden_size, init_method=init_method, config=model_parallel_config()
        )
        if arch.pos_emb == "learned":
            # Drawn with the other weights (init_methods.initialise_parameters), not here.
            self.position_embeddings = torch.nn.Embedding.from_pretrained(
                torch.empty(arch.max_position_embeddings, arch.hidden_size), freeze=False
            )
        else:
            self.position_embeddings = None

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.word_embeddings(input_ids)
        if self.position_embeddings is not None:
            hidden = hidden + self.position_embeddings(position_ids)
        return F.dropout(hidden, p=self.hidden_dropout, training=self.training)
