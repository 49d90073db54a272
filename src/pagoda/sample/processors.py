"""Logit edits applied to every row before the greedy/random split, all in place."""

from __future__ import annotations

import functools

import torch

from pagoda.sample.metadata import PenaltyTensors, TokenUpdate


def apply_token_update(logits: torch.Tensor, update: TokenUpdate, *, accumulate: bool) -> None:
    """Add (accumulate=True) or write the update's values at its (row, token) positions."""
    logits.index_put_((update.rows, update.token_ids), update.values, accumulate=accumulate)


def apply_penalties(logits: torch.Tensor, penalties: PenaltyTensors) -> None:
    """Repetition (prompt + output tokens: divides positive logits, multiplies negative ones), then
    frequency (times the output count) and presence (once per output token), as in OpenAI/vLLM."""
    if penalties.repetition is not None:
        update = penalties.repetition
        index = (update.rows, update.token_ids)
        values = logits[index]
        logits[index] = torch.where(values > 0, values / update.values, values * update.values)
    if penalties.additive is not None:
        apply_token_update(logits, penalties.additive, accumulate=True)


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


@functools.cache
def _banned_bytes_table(device: torch.device) -> torch.Tensor:
    """[256] int64: for each byte value, its 8 bits unpacked into 8 bytes (1 where the bit is 0,
    lowest bit first), so that one lookup per mask byte gives 8 bool "banned" flags."""
    byte = torch.arange(256, dtype=torch.int64)
    banned = 1 - ((byte[:, None] >> torch.arange(8)) & 1)
    return (banned << (8 * torch.arange(8))).sum(dim=1).to(device)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set to -inf every token whose bit is 0 (the grammar backends' packed int32 layout: bit j%32
    of word j//32). Plain torch, as fast as xgrammar's CPU kernel at every batch size measured."""
    batch, vocab_size = logits.shape
    expected = (batch, bitmask_width(vocab_size))
    if bitmask.dtype != torch.int32 or tuple(bitmask.shape) != expected:
        raise ValueError(
            f"token_bitmask must be int32 of shape {expected}, got {bitmask.dtype} of shape {tuple(bitmask.shape)}"
        )
    if bitmask.device != logits.device:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    # Little-endian words: byte j // 8 of the row holds token j's bit at position j % 8.
    mask_bytes = bitmask.contiguous().view(torch.uint8).to(torch.int64)
    table = _banned_bytes_table(logits.device)
    banned = torch.take(table, mask_bytes).view(torch.bool).view(batch, -1)[:, :vocab_size]
    logits.masked_fill_(banned, float("-inf"))
