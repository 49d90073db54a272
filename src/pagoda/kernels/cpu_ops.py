"""CPU kernels for the decode path (`csrc/decode_ops.cpp`): RMSNorm with a fused residual add,
rotary embedding in place, and paged attention for a few query rows per sequence (decodes and
speculative verification) reading K/V through the block tables; and the logprobs and ranks of
chosen tokens in rows of logits (`csrc/logprobs.cpp`), as prompt logprobs and select score them.

Each wrapper says with `applies(...)` whether it can take the given tensors (bf16 on the CPU,
kernels built; `attention_applies` for paged attention, which also takes fp32); callers keep
their PyTorch path for everything else.
"""

from __future__ import annotations

import torch

from pagoda.kernels.build import available
from pagoda.kernels.build import op as _op

_BF16 = torch.bfloat16
_MAX_LOGPROB_ROW = 1 << 24  # csrc/logprobs.cpp's limit


def applies(*tensors: torch.Tensor) -> bool:
    """Whether the kernels take these tensors: bf16 on the CPU, kernels built. (Called a few
    times per layer and step: kept to plain attribute checks.)"""
    for t in tensors:
        if t.dtype is not _BF16 or not t.is_cpu:
            return False
    return available()


def attention_applies(q: torch.Tensor, *tensors: torch.Tensor) -> bool:
    """Whether `paged_attention` takes these tensors: all bf16, or all fp32 (fp32 models), on the
    CPU, kernels built."""
    dtype = q.dtype
    if (dtype is not _BF16 and dtype is not torch.float32) or not q.is_cpu:
        return False
    for t in tensors:
        if t.dtype is not dtype or not t.is_cpu:
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


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Attention of a few new query rows per sequence, `q: [T, H, D]` → `[T, H, D]` (bf16 or
    fp32, the cache and new K/V of the same dtype): sequence
    b's rows are `query_start_loc[b] : query_start_loc[b + 1]` (int32 `[B + 1]`), its last
    positions; each attends causally to its sequence's cached positions up to its own (the last
    `sliding_window` only, if set). One row per sequence is a decode; k + 1 rows verify k drafts.
    With `new_kv = (k, v, slot_mapping)` (`[T, Hkv, D]` twice and int64 `[T]`) the new tokens'
    keys and values are written to their cache slots first, in the same call. Meant for short
    query runs: each (sequence, KV head) task holds `rows x heads-per-KV-head` score rows over
    the context at once (in tiles of up to 64)."""
    k, v, slots = new_kv if new_kv is not None else (None, None, None)
    return _op("paged_attention")(
        q, kv_cache, block_tables, seq_lens, query_start_loc, scale, sliding_window or 0, k, v, slots
    )


def logprobs_applies(logits: torch.Tensor) -> bool:
    """Whether `token_logprobs` takes these logits: on the CPU, rows shorter than 2^24 (its
    counts are fp32 lanes), kernels built."""
    return logits.is_cpu and logits.shape[-1] < _MAX_LOGPROB_ROW and available()


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For `logits: [L, V]` (fp32 or bf16) and `ids: [L, W]` int64, each id's logprob in its row
    (the logit less the row's log-sum-exp, within ~1e-6 of log_softmax) as fp32 `[L, W]`, and
    its rank (1 + the number of strictly larger logits, exact) as int64 `[L, W]`. The logits
    must be finite (raw LM-head outputs): a NaN gives unspecified values in its row."""
    if logits.dtype is not torch.float32:
        logits = logits.float()
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    return _op("token_logprobs")(logits, ids.to(torch.int64).contiguous())
