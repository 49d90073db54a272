"""Dequantization in PyTorch: raw GGML blocks → float32, equal bit for bit to `gguf.quants.dequantize`.

Each function takes `[n_blocks, type_size]` uint8 blocks and returns `[n_blocks, block_size]`
float32, with the same float32 operations in the same order as the reference (so the results
agree exactly, NaN and infinite scales included). `dequantize` applies them to whole rows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagoda.quant.formats import GGMLType, block_size, check_supported, type_size


def half_to_float(raw: torch.Tensor) -> torch.Tensor:
    """fp16 bytes `[..., 2k]` → float32 `[..., k]`. NaNs keep their payload, as numpy converts
    them (torch's conversion makes every NaN the same)."""
    halves = raw.contiguous().view(torch.float16)
    out = halves.float()
    bits = halves.view(torch.int16).to(torch.int32) & 0xFFFF
    nan = ((bits & 0x7C00) == 0x7C00) & ((bits & 0x03FF) != 0)
    if bool(nan.any()):
        patched = ((bits & 0x8000) << 16) | 0x7F800000 | ((bits & 0x03FF) << 13)
        out = torch.where(nan, patched.view(torch.float32), out)
    return out


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 at byte `offset` of each block, as float32 `[n_blocks, 1]`."""
    return half_to_float(blocks[:, offset : offset + 2])


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """`[n, m]` packed bytes → `[n, 2m]` values: all low nibbles, then all high nibbles."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def _bits(packed: torch.Tensor, count: int) -> torch.Tensor:
    """`[n, count // 8]` little-endian bytes → `[n, count]` bits (bit j of the bitfield at j)."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((packed.unsqueeze(-1) >> shifts) & 1).reshape(packed.shape[0], count)


def k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit (scale, min) pairs packed in Q4_K / Q5_K's 12 scale bytes, `[n, 8]` each.

    Bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes 4-7 the same
    for the mins; bytes 8-11 the low 4 bits of scale 4+i (low nibble) and min 4+i (high nibble).
    """
    s = scales.to(torch.int32)
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat((lo & 63, (hi & 0x0F) | ((lo >> 6) << 4)), dim=-1)
    mn = torch.cat((mid & 63, (hi >> 4) | ((mid >> 6) << 4)), dim=-1)
    return sc, mn


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    return b[:, 2:].contiguous().view(torch.int8).float() * d


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    q = _nibbles(b[:, 2:]).to(torch.int8) - 8
    return d * q.float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b, 0), _f16(b, 2)
    q = _nibbles(b[:, 4:]).float()
    return d * q + m


def _q5(b: torch.Tensor, offset: int) -> torch.Tensor:
    """The 5-bit values of a Q5_0 / Q5_1 block whose qh starts at byte `offset`."""
    high = _bits(b[:, offset : offset + 4], 32)
    return _nibbles(b[:, offset + 4 :]) | (high << 4)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    q = _q5(b, 2).to(torch.int8) - 16
    return d * q.float()


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b, 0), _f16(b, 2)
    return d * _q5(b, 4).float() + m


def _k_quant(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Q4_K / Q5_K: `d * sc * q - dmin * m` over 8 sub-blocks of 32 (`q` is `[n, 8, 32]`)."""
    n = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = k_scale_min(b[:, 4:16])
    scale = (d * sc.float()).reshape(n, 8, 1)
    shift = (dmin * mn.float()).reshape(n, 8, 1)
    return (scale * q.float() - shift).reshape(n, 256)


def _k_quant_low(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K / Q5_K's 128 nibble bytes → `[n, 8, 32]`: chunk c of 32 bytes holds sub-block 2c in
    its low nibbles and sub-block 2c + 1 in its high nibbles."""
    chunks = qs.reshape(qs.shape[0], 4, 1, 32)
    return torch.cat((chunks & 0x0F, chunks >> 4), dim=2).reshape(qs.shape[0], 8, 32)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    return _k_quant(b, _k_quant_low(b[:, 16:144]))


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    # qh byte l, bit j: the 5th bit of value l of sub-block j.
    high = _bits(b[:, 16:48], 256).reshape(b.shape[0], 32, 8).transpose(1, 2)
    return _k_quant(b, _k_quant_low(b[:, 48:176]) | (high << 4))


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql, qh = b[:, 0:128], b[:, 128:192]
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    d = _f16(b, 208)
    # Each half of 128 values: 64 ql bytes (low nibbles: values 0-63, high nibbles: 64-127 of the
    # half, in two runs of 32) and 32 qh bytes (2 bits for each of 4 runs of 32).
    low = ql.reshape(n, 2, 1, 64)
    low = torch.cat((low & 0x0F, low >> 4), dim=2).reshape(n, 2, 4, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)
    high = (qh.reshape(n, 2, 1, 32) >> shifts) & 3
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
    return ((d * scales).reshape(n, 16, 1) * q).reshape(n, 256)


def _bf16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.bfloat16).float()


def _f16_values(b: torch.Tensor) -> torch.Tensor:
    return half_to_float(b)


def _f32(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float32).clone()


_DEQUANTIZERS: dict[GGMLType, Callable[[torch.Tensor], torch.Tensor]] = {
    GGMLType.F32: _f32,
    GGMLType.F16: _f16_values,
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


def dequantize(data: torch.Tensor, qtype: int) -> torch.Tensor:
    """Raw rows `[..., row_bytes]` (uint8) of `qtype` → float32 `[..., values_per_row]`."""
    qtype = check_supported(qtype, "dequantize")
    if data.dtype != torch.uint8:
        raise ValueError(f"quantized data must be uint8 bytes, got {data.dtype}")
    ts, bs = type_size(qtype), block_size(qtype)
    if data.shape[-1] % ts:
        raise ValueError(f"{qtype.name} rows need a multiple of {ts} bytes, got {data.shape[-1]}")
    blocks = data.reshape(-1, ts)
    values = _DEQUANTIZERS[qtype](blocks)
    return values.reshape(*data.shape[:-1], data.shape[-1] // ts * bs)
