"""Quantization in PyTorch: float32 rows → raw GGML blocks.

Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, BF16 and F16 follow the reference quantizers of `gguf.quants`
(llama.cpp's `quantize_row_*_ref`) operation for operation, so their bytes are identical. Q4_K,
Q5_K and Q6_K follow llama.cpp's reference algorithm without an importance matrix: per
sub-block a weighted least-squares search over a few candidate scales (`make_qkx2_quants` for
Q4_K/Q5_K, `make_qx_quants` for Q6_K), then 6- or 8-bit scales per super-block and a final
re-rounding against the stored scales. Sums are vectorized, so their rounding (and rarely a
choice between two near-equal candidates) may differ from llama.cpp's sequential C loops; the
blocks are valid and decode to the same error budget.

Where pagoda's CPU kernels run, Q4_K, Q5_K and Q6_K take their C++ port
(`kernels/csrc/quant_kquant.cpp`: the same float32 operations in the same order, so the same bytes,
tests compare), 20-60x faster; `quantize(..., kernels=False)` keeps this module's PyTorch code.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagoda.kernels import cpu_quant
from pagoda.quant.formats import GGMLType, block_size, check_supported

_ROW_CHUNK_BLOCKS = 1 << 14  # K-quant searches hold ~20 candidates per value: bound their memory


def _f16_bytes(x: torch.Tensor) -> torch.Tensor:
    """float32 `[n, 1]` → its fp16 bytes `[n, 2]` (round to nearest even, as numpy)."""
    return x.to(torch.float16).view(torch.uint8).reshape(x.shape[0], 2)


def _inverse(d: torch.Tensor) -> torch.Tensor:
    """`1 / d`, or 0 where d is 0 (the reference's `id = d ? 1/d : 0`)."""
    return torch.where(d == 0, torch.zeros_like(d), 1.0 / d)


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    """`roundf`: halves away from zero, computed as the reference's `np_roundf`."""
    a = x.abs()
    floored = torch.floor(a)
    return torch.sign(x) * (floored + torch.floor(2 * (a - floored)))


def _nearest_int(x: torch.Tensor) -> torch.Tensor:
    """llama.cpp's `nearest_int` (adds 1.5 * 2^23): round half to even, as an int32."""
    return torch.round(x).to(torch.int32)


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """`[n, 2m]` values < 16 → `[n, m]` bytes: value j low, value j + m high."""
    half = q.shape[-1] // 2
    return (q[:, :half] & 0x0F) | ((q[:, half:] & 0x0F) << 4)


def _pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """`[n, 8k]` bits → `[n, k]` little-endian bytes."""
    weights = (1 << torch.arange(8, dtype=torch.int32)).reshape(1, 1, 8)
    grouped = bits.to(torch.int32).reshape(bits.shape[0], -1, 8)
    return (grouped * weights).sum(-1).to(torch.uint8)


def _abs_max_signed(x: torch.Tensor) -> torch.Tensor:
    """The value of largest magnitude in each row (the first one on ties), `[n, 1]`."""
    index = x.abs().argmax(dim=-1, keepdim=True)
    return torch.gather(x, -1, index)


# ---- legacy 32-value blocks (bit-exact with gguf.quants) --------------------------------------------
def _q8_0(x: torch.Tensor) -> torch.Tensor:
    d = x.abs().amax(dim=-1, keepdim=True) / 127
    q = _round_half_away(x * _inverse(d)).to(torch.int8).view(torch.uint8)
    return torch.cat((_f16_bytes(d), q), dim=-1)


def _symmetric(x: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_0 / Q5_0: d = max / -(levels / 2), q = trunc(x / d + levels / 2 + 0.5) clipped."""
    d = _abs_max_signed(x) / -(levels // 2)
    q = torch.trunc(x * _inverse(d) + (levels // 2 + 0.5)).clamp(0, levels - 1).to(torch.uint8)
    return d, q


def _affine(x: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 / Q5_1: d = (max - min) / (levels - 1), q = trunc((x - min) / d + 0.5) clipped."""
    lo = x.amin(dim=-1, keepdim=True)
    hi = x.amax(dim=-1, keepdim=True)
    d = (hi - lo) / (levels - 1)
    q = torch.trunc((x - lo) * _inverse(d) + 0.5).clamp(0, levels - 1).to(torch.uint8)
    return d, lo, q


def _q4_0(x: torch.Tensor) -> torch.Tensor:
    d, q = _symmetric(x, 16)
    return torch.cat((_f16_bytes(d), _pack_nibbles(q)), dim=-1)


def _q4_1(x: torch.Tensor) -> torch.Tensor:
    d, lo, q = _affine(x, 16)
    return torch.cat((_f16_bytes(d), _f16_bytes(lo), _pack_nibbles(q)), dim=-1)


def _q5_0(x: torch.Tensor) -> torch.Tensor:
    d, q = _symmetric(x, 32)
    return torch.cat((_f16_bytes(d), _pack_bits(q >> 4), _pack_nibbles(q)), dim=-1)


def _q5_1(x: torch.Tensor) -> torch.Tensor:
    d, lo, q = _affine(x, 32)
    return torch.cat((_f16_bytes(d), _f16_bytes(lo), _pack_bits(q >> 4), _pack_nibbles(q)), dim=-1)


def _bf16(x: torch.Tensor) -> torch.Tensor:
    """ggml's fp32 → bf16: NaNs made quiet, otherwise round to nearest even."""
    n = x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    nan = (n & 0x7FFFFFFF) > 0x7F800000
    rounded = (n + (0x7FFF + ((n >> 16) & 1))) >> 16
    quiet = ((n & 0xFFFF0000) | (64 << 16)) >> 16
    out = torch.where(nan, quiet, rounded) & 0xFFFF
    out = torch.where(out >= 0x8000, out - 0x10000, out)  # as a signed 16-bit pattern
    return out.to(torch.int16).view(torch.uint8).reshape(x.shape[0], 2)


def _f16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).view(torch.uint8).reshape(x.shape[0], 2)


def _f32(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8).reshape(x.shape[0], 4)


# ---- K-quants (llama.cpp's reference algorithm) -----------------------------------------------------
def _seq_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over the first dimension in order, in float32, as the reference's C loops do (torch's
    reductions sum pairwise and would round differently). Element-major layouts keep each step
    one contiguous vector operation."""
    acc = t[0].clone()
    for i in range(1, t.shape[0]):
        acc += t[i]
    return acc


def _fit_scale_min(
    x: torch.Tensor, weights: torch.Tensor, nmax: int, rmin: float, rdelta: float, nstep: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`make_qkx2_quants` over sub-blocks given element-major, `x: [32, n]`: the scales `[n]`,
    the (positive) mins `[n]` and the levels `[32, n]` in [0, nmax] minimizing the weighted
    squared error of `scale * L - min`.

    The candidates are tried in order, each from the best min found so far (the search is path
    dependent, as the reference's), one step for all sub-blocks at once."""
    lo = x.amin(0).clamp(max=0)
    hi = x.amax(0)
    flat = hi == lo
    sum_w = _seq_sum(weights)
    sum_x = _seq_sum(weights * x)

    span = torch.where(flat, torch.ones_like(hi), hi - lo)
    iscale = nmax / span
    scale = 1 / iscale
    levels = _nearest_int(iscale * (x - lo)).clamp(0, nmax)
    diff = scale * levels + lo - x
    best = _seq_sum(weights * (diff * diff))
    best_min = lo
    rdelta32 = torch.tensor(rdelta, dtype=torch.float32)
    for step in range(nstep + 1):
        offset = torch.tensor(rmin, dtype=torch.float32) + rdelta32 * step
        span = torch.where(flat, torch.ones_like(hi), hi - best_min)
        cand = _nearest_int((offset + nmax) / span * (x - best_min)).clamp(0, nmax)
        lf = cand.float()
        wl = weights * lf
        sum_l, sum_l2, sum_xl = _seq_sum(wl), _seq_sum(wl * lf), _seq_sum(wl * x)
        det = sum_w * sum_l2 - sum_l * sum_l
        valid = det > 0
        safe_det = torch.where(valid, det, torch.ones_like(det))
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / safe_det
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / safe_det
        positive = this_min > 0
        safe_l2 = torch.where(sum_l2 > 0, sum_l2, torch.ones_like(sum_l2))
        this_scale = torch.where(positive, sum_xl / safe_l2, this_scale)
        this_min = torch.where(positive, torch.zeros_like(this_min), this_min)
        diff = this_scale * lf + this_min - x
        err = _seq_sum(weights * (diff * diff))
        better = valid & (err < best) & ~flat
        levels = torch.where(better, cand, levels)
        best = torch.where(better, err, best)
        scale = torch.where(better, this_scale, scale)
        best_min = torch.where(better, this_min, best_min)

    scale = torch.where(flat, torch.zeros_like(scale), scale)
    levels = torch.where(flat, torch.zeros_like(levels), levels)
    best_min = torch.where(flat, lo, best_min)
    return scale, -best_min, levels


def _k_weights(x: torch.Tensor) -> torch.Tensor:
    """The reference's importance of each value without an imatrix (element-major `[32, n]`):
    rms of the sub-block + |x|. The square root is taken in float64 and rounded once to float32:
    the correctly rounded `sqrtf` of the reference (torch's float32 sqrt may be 1 ulp off)."""
    return torch.sqrt((_seq_sum(x * x) / x.shape[0]).double()).float() + x.abs()


def _quantize_6bit(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sub-block scales or mins `[n, 8]` (non-negative) → (6-bit levels, super-block step)."""
    top = values.amax(-1, keepdim=True).clamp(min=0)
    inv = torch.where(top > 0, 63.0 / torch.where(top > 0, top, torch.ones_like(top)), torch.zeros_like(top))
    # uint8_t ls = nearest_int(...): negative results wrap around before MIN(63, .).
    levels = (_nearest_int(inv * values) & 0xFF).clamp(max=63)
    return levels, top / 63.0


def _pack_k_scales(sc: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """Eight 6-bit (scale, min) pairs → Q4_K / Q5_K's 12 bytes (see dequant.k_scale_min)."""
    lo = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    mid = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    hi = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return torch.cat((lo, mid, hi), dim=-1).to(torch.uint8)


def _k_quant_levels(x: torch.Tensor, nmax: int, rmin: float, rdelta: float, nstep: int):
    """Shared Q4_K / Q5_K work for super-blocks `x: [n, 256]`: (d, dmin, packed scales, levels)."""
    n = x.shape[0]
    sub = x.reshape(n * 8, 32).t().contiguous()  # element-major: [32, sub-blocks]
    scale, mins, levels = _fit_scale_min(sub, _k_weights(sub), nmax, rmin, rdelta, nstep)
    levels = levels.t()
    ls, d = _quantize_6bit(scale.reshape(n, 8))
    lm, dmin = _quantize_6bit(mins.reshape(n, 8))
    d_bytes, dmin_bytes = _f16_bytes(d), _f16_bytes(dmin)
    # Re-round every value against the scales as stored (fp16 steps, 6-bit levels).
    d_sub = d_bytes.view(torch.float16).float() * ls.float()
    m_sub = dmin_bytes.view(torch.float16).float() * lm.float()
    safe = torch.where(d_sub == 0, torch.ones_like(d_sub), d_sub)
    requant = _nearest_int((x.reshape(n, 8, 32) + m_sub.unsqueeze(-1)) / safe.unsqueeze(-1)).clamp(0, nmax)
    keep = (d_sub == 0).unsqueeze(-1)  # the reference skips those sub-blocks: levels from the search
    levels = torch.where(keep, levels.reshape(n, 8, 32), requant)
    return d_bytes, dmin_bytes, _pack_k_scales(ls, lm), levels.to(torch.uint8)


def _k_nibbles(levels: torch.Tensor) -> torch.Tensor:
    """`[n, 8, 32]` levels → the 128 nibble bytes: chunk c = sub-block 2c low | 2c + 1 high."""
    pairs = levels.reshape(levels.shape[0], 4, 2, 32)
    return ((pairs[:, :, 0] & 0x0F) | ((pairs[:, :, 1] & 0x0F) << 4)).reshape(levels.shape[0], 128)


def _q4_k(x: torch.Tensor) -> torch.Tensor:
    d, dmin, scales, levels = _k_quant_levels(x, 15, -1.0, 0.1, 20)
    return torch.cat((d, dmin, scales, _k_nibbles(levels)), dim=-1)


def _q5_k(x: torch.Tensor) -> torch.Tensor:
    d, dmin, scales, levels = _k_quant_levels(x, 31, -0.5, 0.1, 15)
    # qh byte l, bit j: the 5th bit of value l of sub-block j.
    high = (levels >> 4).transpose(1, 2).reshape(x.shape[0], 256)
    return torch.cat((d, dmin, scales, _pack_bits(high), _k_nibbles(levels)), dim=-1)


def _fit_symmetric(x: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`make_qx_quants(n, nmax, x, L, rmse_type=1)` over sub-blocks given element-major,
    `x: [16, n]`: the scales `[n]` and the levels `[16, n]` in [0, 2 * nmax) (offset by nmax)
    maximizing sum(w x l)^2 / sum(w l^2), w = x^2, over 19 candidate steps tried in order."""
    top = _abs_max_signed(x.t()).squeeze(-1)
    zero = top.abs() < 1e-15
    safe_top = torch.where(zero, torch.ones_like(top), top)
    w = x * x
    wx = w * x

    def fit(iscale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        levels = _nearest_int(iscale * x).clamp(-nmax, nmax - 1)
        lf = levels.float()
        return levels, _seq_sum(wx * lf), _seq_sum((w * lf) * lf)

    def ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
        return num / torch.where(den != 0, den, torch.ones_like(den))

    levels, sumlx, suml2 = fit(-nmax / safe_top)
    scale = torch.where(suml2 != 0, ratio(sumlx, suml2), torch.zeros_like(suml2))
    best = scale * sumlx
    tenth = torch.tensor(0.1, dtype=torch.float32)
    for step in (*range(-9, 0), *range(1, 10)):
        cand, cand_lx, cand_l2 = fit(-(nmax + tenth * step) / safe_top)
        better = (cand_l2 > 0) & (cand_lx * cand_lx > best * cand_l2)
        levels = torch.where(better, cand, levels)
        scale = torch.where(better, ratio(cand_lx, cand_l2), scale)
        best = torch.where(better, scale * cand_lx, best)
    scale = torch.where(zero, torch.zeros_like(scale), scale)
    levels = torch.where(zero, torch.full_like(levels, -nmax), levels)
    return scale, levels + nmax


def _q6_k(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[0]
    scales, levels = _fit_symmetric(x.reshape(n * 16, 16).t().contiguous(), 32)
    scales, levels = scales.reshape(n, 16), levels.t().reshape(n, 16, 16)
    top = _abs_max_signed(scales)
    empty = (top.abs() < 1e-15).squeeze(-1)
    safe_top = torch.where(empty.unsqueeze(-1), torch.ones_like(top), top)
    iscale = -128.0 / safe_top
    d_bytes = _f16_bytes(1 / iscale)
    sc = _nearest_int(iscale * scales).clamp(max=127)
    d_sub = d_bytes.view(torch.float16).float() * sc.float()
    safe = torch.where(d_sub == 0, torch.ones_like(d_sub), d_sub)
    requant = _nearest_int(x.reshape(n, 16, 16) / safe.unsqueeze(-1)).clamp(-32, 31) + 32
    levels = torch.where((d_sub == 0).unsqueeze(-1), levels, requant).reshape(n, 2, 4, 32)
    # Per half of 128: ql[0:32] = run0 | run2 << 4, ql[32:64] = run1 | run3 << 4, qh = 2 bits of each run.
    low = levels & 0x0F
    ql = torch.cat((low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)), dim=-1)
    high = levels >> 4
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    block = torch.cat(
        (
            ql.reshape(n, 128).to(torch.uint8),
            qh.reshape(n, 64).to(torch.uint8),
            sc.to(torch.int8).view(torch.uint8),
            d_bytes,
        ),
        dim=-1,
    )
    return torch.where(empty.unsqueeze(-1), torch.zeros_like(block), block)


_QUANTIZERS: dict[GGMLType, Callable[[torch.Tensor], torch.Tensor]] = {
    GGMLType.F32: _f32,
    GGMLType.F16: _f16,
    GGMLType.BF16: _bf16,
    GGMLType.Q8_0: _q8_0,
    GGMLType.Q4_0: _q4_0,
    GGMLType.Q4_1: _q4_1,
    GGMLType.Q5_0: _q5_0,
    GGMLType.Q5_1: _q5_1,
    GGMLType.Q4_K: _q4_k,
    GGMLType.Q5_K: _q5_k,
    GGMLType.Q6_K: _q6_k,
}


def quantize(x: torch.Tensor, qtype: int, kernels: bool = True) -> torch.Tensor:
    """float rows `[..., n]` → raw `qtype` rows `[..., row_bytes]` (uint8). `kernels=False`
    runs the PyTorch quantizer even where the C++ one could (tests)."""
    qtype = check_supported(qtype, "quantize")
    bs = block_size(qtype)
    if x.shape[-1] % bs:
        raise ValueError(f"a {qtype.name} row needs a multiple of {bs} values, got {x.shape[-1]}")
    blocks = x.detach().to(torch.float32).reshape(-1, bs)
    if kernels and cpu_quant.quantizes(qtype):
        return cpu_quant.quantize_k(blocks.contiguous(), int(qtype)).reshape(*x.shape[:-1], -1)
    fn = _QUANTIZERS[qtype]
    step = _ROW_CHUNK_BLOCKS if qtype in (GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K) else blocks.shape[0]
    parts = [fn(blocks[i : i + step]) for i in range(0, blocks.shape[0], max(step, 1))]
    out = torch.cat(parts) if len(parts) != 1 else parts[0]
    return out.reshape(*x.shape[:-1], -1)
