"""Integer GEMM for Q8_0, Q4_0, Q5_0, Q4_K and Q6_K weights on few rows (decode), in the CPU kernel
variants.

`pack(qtype, rows, K)` repacks Q8_0 / Q4_0 GGUF rows once (values and fp16 scales in two arrays,
the same bytes; Q5_0, Q4_K and Q6_K are read as the file's blocks); `linear(x, packed)` quantizes x to
8 bits per block of 32 (as llama.cpp does) and sums
exact integer block dot products (`csrc/quant_gemm.cpp`: vpdpbusd with AVX512-VNNI / AVX-VNNI,
vpmaddubsw otherwise). The result differs from the float product of the dequantized weight by
the rounding of x to 8 bits (at most half a step of each block's scale per value).

Where the kernels do not run (`pagoda.kernels.build.available()` is False) callers keep the
PyTorch reference (dequantize, then `F.linear`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagoda.kernels.build import available, ops

# GGML type ids the kernels take.
Q8_0, Q4_0, Q5_0, Q4_K, Q6_K = 8, 2, 6, 12, 14
SUPPORTED = (Q8_0, Q4_0, Q5_0, Q4_K, Q6_K)
REPACKED = (Q8_0, Q4_0)  # the others are read as GGUF stores them
BLOCK = 32


@dataclass(frozen=True)
class PackedQuant:
    qtype: int
    values: torch.Tensor  # [N, K] int8 values (Q8_0), [N, K / 2] nibbles (Q4_0), or the raw rows
    scales: torch.Tensor  # [N, K / 32] fp16 bits (int16); empty for raw rows
    rows: int
    cols: int

    @property
    def raw(self) -> bool:
        """The rows as GGUF stores them (the caller keeps them for dequantizing)."""
        return self.qtype not in REPACKED

    @property
    def nbytes(self) -> int:
        return self.values.numel() + 2 * self.scales.numel()


def supports(qtype: int, cols: int) -> bool:
    """Whether a kernel multiplies `qtype` rows of `cols` values here."""
    block = 256 if int(qtype) in (Q4_K, Q6_K) else BLOCK
    return int(qtype) in SUPPORTED and cols % block == 0 and available()


def pack(qtype: int, raw: torch.Tensor, cols: int) -> PackedQuant:
    """GGUF rows `raw: uint8 [N, row_bytes]` of `qtype` → the kernel's layout."""
    qtype = int(qtype)
    if qtype not in SUPPORTED:
        raise ValueError(f"no integer kernel for GGML type {qtype}")
    if qtype not in REPACKED:
        return PackedQuant(qtype, raw.contiguous(), torch.empty(0, dtype=torch.int16), raw.shape[0], cols)
    values, scales = ops().quant_pack(raw.contiguous(), qtype, cols)
    return PackedQuant(qtype, values, scales, raw.shape[0], cols)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`x: [M, K]` (float32 or bfloat16) → (int8 values, float32 block scales, int32 block sums)."""
    return ops().quant_act_q8(x.contiguous())


def linear(x: torch.Tensor, packed: PackedQuant, quantized=None) -> torch.Tensor:
    """float32 `[M, N] = x [M, K] @ W.T`; pass `quantized` (from `quantize_activations(x)`) to
    reuse one quantization of x across several weights."""
    xq, xd, xs = quantized if quantized is not None else quantize_activations(x)
    return ops().quant_linear(xq, xd, xs, packed.values, packed.scales, packed.qtype)


def _dequantize(qtype: int, values: torch.Tensor, scales: torch.Tensor, cols: int) -> torch.Tensor:
    rows = values.shape[0]
    d = scales.view(torch.float16).float().reshape(rows, -1, 1)
    if qtype == Q8_0:
        q = values.view(torch.int8).float().reshape(rows, -1, BLOCK)
    else:
        v = values.reshape(rows, -1, BLOCK // 2)
        q = torch.cat((v & 0x0F, v >> 4), dim=-1).float() - 8
    return (q * d).reshape(rows, cols)


def dequantize(packed: PackedQuant) -> torch.Tensor:
    """float32 `[N, K]` of a repacked (Q8_0 / Q4_0) weight: the values its blocks decode to."""
    if packed.raw:
        raise ValueError("raw rows are dequantized by their GGML type, not here")
    return _dequantize(packed.qtype, packed.values, packed.scales, packed.cols)


def dequantize_rows(packed: PackedQuant, rows: torch.Tensor) -> torch.Tensor:
    """float32 rows `rows` (1-D) of a repacked weight (an embedding lookup from a tied head)."""
    if packed.raw:
        raise ValueError("raw rows are dequantized by their GGML type, not here")
    return _dequantize(packed.qtype, packed.values[rows], packed.scales[rows], packed.cols)


def dot_kind() -> str:
    """Which integer dot product the kernels use on this CPU (avx512_vnni, avx_vnni or avx2_maddubs)."""
    return ops().quant_dot_kind()
