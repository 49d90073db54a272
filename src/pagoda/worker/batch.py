"""The messages the scheduling rank sends the model workers: one step's forward pass as plain data.

A `ForwardBatch` holds only tensors and ints (no `Request`, generator or grammar matcher), so the
same object runs in-process (`UniprocExecutor`) or is broadcast to every tensor-parallel rank
(`MultiprocExecutor`). What the batch's logits are used for (sampling, grammar masks, logprobs,
drafts, seeds) stays with the runner on rank 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagoda.attention.metadata import AttentionMetadata


def _padded_tables(
    chunks: Sequence[tuple[Sequence[int], int, Sequence[int]]], seq_lens: Sequence[int], bs: int
) -> torch.Tensor:
    """int32 [B, max_blocks]: each sequence's blocks covering its `seq_lens`, padded with 0."""
    max_blocks = max(-(-sl // bs) for sl in seq_lens)
    return torch.tensor(
        [list(b[:max_blocks]) + [0] * (max_blocks - len(b)) for _, _, b in chunks], dtype=torch.int32
    )


@dataclass
class ForwardBatch:
    """T new tokens of B sequences, fewest new tokens first (decodes lead).

    Sequence i's tokens are `input_ids[query_start_loc[i]:query_start_loc[i + 1]]`; see
    `AttentionMetadata` for the rest. All tensors are on the CPU (each worker moves them to its
    device). `logits_rows` are the flat rows whose hidden state goes through the LM head."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    seq_lens: list[int]  # [B]: context length including this step's tokens
    query_start_loc: list[int]  # [B + 1]
    num_decodes: int
    block_size: int
    logits_rows: torch.Tensor  # [N] int64
    block_copies: list[tuple[int, int]]  # (src, dst) KV block copies, before the forward pass

    @classmethod
    def build(
        cls,
        chunks: Sequence[tuple[Sequence[int], int, Sequence[int]]],
        block_size: int,
        logits_rows: Sequence[int],
        block_copies: list[tuple[int, int]],
    ) -> ForwardBatch:
        """chunks: per sequence, fewest new tokens first, (its new token ids, the position of the
        first, its block table). `logits_rows` are flat rows of the new tokens."""
        if all(len(ids) == 1 for ids, _, _ in chunks):
            return cls._decodes(chunks, block_size, logits_rows, block_copies)
        return cls._general(chunks, block_size, logits_rows, block_copies)

    @classmethod
    def _general(
        cls,
        chunks: Sequence[tuple[Sequence[int], int, Sequence[int]]],
        block_size: int,
        logits_rows: Sequence[int],
        block_copies: list[tuple[int, int]],
    ) -> ForwardBatch:
        """`build` for any batch (the tests compare the decode-only path with it)."""
        bs = block_size
        input_ids: list[int] = []
        positions: list[int] = []
        seq_lens: list[int] = []
        query_start = [0]
        for ids, start, _ in chunks:
            input_ids.extend(ids)
            positions.extend(range(start, start + len(ids)))
            seq_lens.append(start + len(ids))
            query_start.append(query_start[-1] + len(ids))
        num_decodes = sum(len(ids) == 1 for ids, _, _ in chunks)  # sorted: decodes come first
        pos = torch.tensor(positions, dtype=torch.int64)
        block_tables = _padded_tables(chunks, seq_lens, bs)
        row = torch.repeat_interleave(
            torch.arange(len(chunks)), torch.tensor([len(ids) for ids, _, _ in chunks])
        )
        slot_mapping = block_tables[row, pos // bs].long() * bs + pos % bs
        return cls(
            input_ids=torch.tensor(input_ids, dtype=torch.int64),
            positions=pos,
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            seq_lens=seq_lens,
            query_start_loc=query_start,
            num_decodes=num_decodes,
            block_size=bs,
            logits_rows=torch.tensor(logits_rows, dtype=torch.int64),
            block_copies=block_copies,
        )

    @classmethod
    def _decodes(
        cls,
        chunks: Sequence[tuple[Sequence[int], int, Sequence[int]]],
        bs: int,
        logits_rows: Sequence[int],
        block_copies: list[tuple[int, int]],
    ) -> ForwardBatch:
        """`build` for a batch of decodes only (one new token per sequence; every step of a
        single stream): the same tensors, from Python ints without the general path's tensor ops."""
        positions = [start for _, start, _ in chunks]
        seq_lens = [start + 1 for start in positions]
        slots = [b[start // bs] * bs + start % bs for (_, start, b) in chunks]
        return cls(
            input_ids=torch.tensor([ids[0] for ids, _, _ in chunks], dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=_padded_tables(chunks, seq_lens, bs),
            seq_lens=seq_lens,
            query_start_loc=list(range(len(chunks) + 1)),
            num_decodes=len(chunks),
            block_size=bs,
            logits_rows=torch.tensor(logits_rows, dtype=torch.int64),
            block_copies=block_copies,
        )

    def attention_metadata(self, device: torch.device) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping.to(device, non_blocking=True),
            block_tables=self.block_tables.to(device, non_blocking=True),
            seq_lens=torch.tensor(self.seq_lens, dtype=torch.int32).to(device, non_blocking=True),
            query_start_loc=torch.tensor(self.query_start_loc, dtype=torch.int32).to(
                device, non_blocking=True
            ),
            num_decodes=self.num_decodes,
            seq_lens_cpu=self.seq_lens,
            query_start_loc_cpu=self.query_start_loc,
            block_size=self.block_size,
        )


@dataclass
class LogitsRows:
    """More rows of the last forward pass's hidden states through the LM head (prompt logprobs
    beyond what fits in one call)."""

    rows: torch.Tensor  # [N] int64


@dataclass
class Shutdown:
    """The workers leave their loop and the process group."""
