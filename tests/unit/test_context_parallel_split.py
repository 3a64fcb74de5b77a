"""Context parallelism's split without ranks: which tokens a rank holds, and its queries' rows of the mask."""

from __future__ import annotations

import torch

from megatron.data.batches import block_causal_mask
from megatron.model.attention import sliding_window_mask
from megatron.model.context_parallel import ContextParallelSplit, own_token_indices


def test_rank_i_of_c_holds_chunks_i_and_2c_minus_1_minus_i_and_together_every_token_once():
    # 16 tokens in 8 chunks of 2 at size 4 (Megatron's load-balanced causal split)
    assert own_token_indices(16, 4, 0).tolist() == [0, 1, 14, 15]
    assert own_token_indices(16, 4, 1).tolist() == [2, 3, 12, 13]
    assert own_token_indices(16, 4, 3).tolist() == [6, 7, 8, 9]
    every = torch.cat([own_token_indices(24, 3, rank) for rank in range(3)])
    assert sorted(every.tolist()) == list(range(24))


def test_a_ranks_query_rows_are_the_whole_sequences_rows_of_its_tokens():
    """Causal, a sliding window and packed documents apart, as one rank masks the whole sequence."""
    documents = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2]])
    whole = block_causal_mask(documents) & sliding_window_mask(16, 3)
    for rank in range(2):
        share = ContextParallelSplit(16, own_token_indices(16, 2, rank))
        rows = share.query_mask(block_causal_mask(documents), sliding_window_width=3)
        assert torch.equal(rows, whole[:, :, share.indices])
        causal = torch.ones(16, 16, dtype=torch.bool).tril()
        assert torch.equal(share.query_mask(None, 3)[0, 0], (causal & ~causal.tril(-4))[share.indices])
        # plain causal attention needs no rows: each chunk attends to the keys up to its end (causal_chunk_attention)
        assert share.query_mask(None, None) is None and share.query_mask(None, 15) is None
        assert torch.equal(share.own(documents), documents[:, share.indices])
