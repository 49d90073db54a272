"""bf16 CPU kernels for the decode path (`csrc/decode_ops.cpp`): RMSNorm with a fused residual
add, rotary embedding in place, and paged decode attention reading K/V through the block tables.

Each wrapper says with `applies(...)` whether it can take the given tensors (bf16 on the CPU,
kernels built); callers keep their PyTorch path for everything else.
"""

from __future__ import annotations

import torch

from pagoda.kernels.build import available
from pagoda.kernels.build import op as _op

_BF16 = torch.bfloat16


def applies(*tensors: torch.Tensor) -> bool:
    """Whether the kernels take these tensors: bf16 on the CPU, kernels built. (Called a few
    times per layer and step: kept to plain attribute checks.)"""
    for t in tensors:
        if t.dtype is not _BF16 or not t.is_cpu:
            return False
    return available()


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(weight * norm(s), s)` with `s = x + residual` (or `x`), rounding where transformers' bf16
    RMSNorm rounds; x is `[..., H]`."""
    if x.dim() == 2 and x.stride(-1) == 1 and (residual is None or residual.stride(-1) == 1):
        return _op("add_rms_norm")(x, residual, weight, eps)
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    res = None if residual is None else residual.reshape(-1, shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    if res is not None and res.stride(-1) != 1:
        res = res.contiguous()
    out, summed = _op("add_rms_norm")(flat, res, weight, eps)
    return out.view(shape), summed.view(shape)


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x: [T, heads, head_dim]` in place (rotate-half convention) with `cos`, `sin`
    `[T, 1, head_dim // 2]`, rounding like the torch expression; returns x."""
    _op("rotary_")(x, cos, sin)
    return x


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Attention of one new query token per sequence, `q: [B, H, D]`, over the sequence's
    `seq_lens[b]` cached positions (its last `sliding_window` only, if set) → `[B, H, D]`.
    With `new_kv = (k, v, slot_mapping)` (`[B, Hkv, D]` twice and int64 `[B]`) the new tokens'
    keys and values are written to their cache slots first, in the same call."""
    k, v, slots = new_kv if new_kv is not None else (None, None, None)
    return _op("paged_decode_attention")(
        q, kv_cache, block_tables, seq_lens, scale, sliding_window or 0, k, v, slots
    )
