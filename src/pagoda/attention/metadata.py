"""What the model runner tells the attention backend about one forward pass."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """A flat batch of B sequences and T new tokens.

    The runner orders sequences by their number of new tokens, fewest first: the first
    `num_decodes` have exactly one new token each (decodes); the rest (speculative verification
    steps of k + 1 tokens, prefills, possibly chunks of a prompt, possibly after a prefix-cache
    hit) follow. Sequence i's new tokens are `query_start_loc[i]:query_start_loc[i+1]` in the flat batch,
    at positions `seq_lens[i] - query_len_i ... seq_lens[i] - 1`; it attends to every cached token
    of its own sequence at a position <= its own (causal), read through `block_tables[i]`.
    """

    slot_mapping: torch.Tensor  # [T] int64: KV cache slot (block_id * block_size + offset) of each new token
    block_tables: torch.Tensor  # [B, max_num_blocks] int32, padded with 0 past each sequence's blocks
    seq_lens: torch.Tensor  # [B] int32: context length including this step's tokens
    query_start_loc: torch.Tensor  # [B + 1] int32
    num_decodes: int
    # Host-side copies, so backends can loop over prefills without device syncs.
    seq_lens_cpu: list[int]
    query_start_loc_cpu: list[int]
    block_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_cpu[-1]

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu, default=0)

    def num_leading_seqs_with_at_most(self, query_len: int) -> int:
        """How many sequences from the first on have at most `query_len` new tokens each (in the
        runner's order, fewest first, that is all of them). Computed once per step and length."""
        cache = self.__dict__.setdefault("_leading_counts", {})
        count = cache.get(query_len)
        if count is None:
            starts = self.query_start_loc_cpu
            count = 0
            while count < len(starts) - 1 and starts[count + 1] - starts[count] <= query_len:
                count += 1
            cache[query_len] = count
        return count
