"""Logit edits applied to every row before the greedy/random split, all in place."""

from __future__ import annotations

import torch
import xgrammar

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


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set to -inf every token whose bit is 0 (xgrammar's packed int32 layout, bit j%32 of word j//32)."""
    batch, vocab_size = logits.shape
    expected = (batch, bitmask_width(vocab_size))
    if bitmask.dtype != torch.int32 or tuple(bitmask.shape) != expected:
        raise ValueError(
            f"token_bitmask must be int32 of shape {expected}, got {bitmask.dtype} of shape {tuple(bitmask.shape)}"
        )
    if bitmask.device != logits.device:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab_size)
