"""Integer GEMM for GGML block weights (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) in the CPU
kernel variants.

`pack(qtype, rows, K)` repacks GGUF rows once into the kernels' tiled layout
(`csrc/quant_layout.h`: 16 output rows interleaved per 32-value block, the scales next to the
values for the 32-value block types but Q8_0, apart for Q8_0 and the K-quants; the
file's bytes, Q4_K / Q5_K's 6-bit scales widened to bytes; on huge pages, `memory.py`); `linear(x, [packed, ...])`
quantizes x to 8 bits per block of 32 (as llama.cpp does) and sums exact integer block dot
products, 16 output rows per instruction (`csrc/quant_gemm.cpp`: vpdpbusd with AVX512-VNNI /
AVX-VNNI, vpmaddubsw otherwise), then adds the bias or applies SwiGLU in the same call. The
result differs from the float product of the dequantized weight by the rounding of x to 8 bits
(at most half a step of each block's scale per value). `raw_rows` gives rows back as the file
stores them, for the reference dequantizer.

Where the kernels do not run (`pagoda.kernels.build.available()` is False) callers keep the
PyTorch reference (dequantize, then `F.linear`).

Benchmark: `python -m pagoda.quant.kernel_bench` (against the bf16 kernel, per row count).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from pagoda.kernels.build import available, op, ops
from pagoda.kernels.memory import huge_page_copy

# GGML type ids the kernels take, and values per scale group (a row must hold whole groups).
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 6, 7, 8, 12, 13, 14
GROUP_VALUES = {Q8_0: 32, Q4_0: 32, Q4_1: 32, Q5_0: 32, Q5_1: 32, Q4_K: 256, Q5_K: 256, Q6_K: 256}
SUPPORTED = tuple(GROUP_VALUES)
TILE_ROWS = 16


@dataclass(frozen=True)
class PackedQuant:
    """A `[rows, cols]` weight of GGML type `qtype` in the tiled layout: `values` and `scales` are
    uint8 `[tiles, ...]`. With `swiglu` the weight is `[gate; up]` and its tiles come in (gate,
    up) pairs."""

    qtype: int
    values: torch.Tensor
    scales: torch.Tensor
    rows: int
    cols: int
    swiglu: bool = False

    @property
    def nbytes(self) -> int:
        return self.values.numel() + self.scales.numel()


def supports(qtype: int, cols: int) -> bool:
    """Whether a kernel multiplies `qtype` rows of `cols` values here."""
    group = GROUP_VALUES.get(int(qtype))
    return group is not None and cols % group == 0 and available()


def pack(qtype: int, raw: torch.Tensor, cols: int, swiglu: bool = False) -> PackedQuant:
    """GGUF rows `raw: uint8 [N, row_bytes]` of `qtype` → the kernels' layout (with `swiglu`,
    raw is `[gate; up]`)."""
    qtype = int(qtype)
    if qtype not in GROUP_VALUES:
        raise ValueError(f"no integer kernel for GGML type {qtype}")
    values, scales = ops().quant_pack(raw.contiguous(), qtype, cols, swiglu)
    return PackedQuant(qtype, huge_page_copy(values), huge_page_copy(scales), raw.shape[0], cols, swiglu)


def linear(
    x: torch.Tensor,
    segments: Sequence[PackedQuant],
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`x [M, K] @ W.T (+ bias)` where W stacks `segments` along its rows (or `silu(gate) * up`
    for one `swiglu` segment); `bias` is float32 over all rows. The result is in x's dtype
    (float32 or bfloat16), or float32 with `out_dtype=torch.float32`."""
    return Stack(tuple(segments), bias)(x, out_dtype is torch.float32)


class Stack:
    """The segments of one weight (stacked along its rows) and its bias, with the kernel call's
    arguments gathered once: `stack(x, out_fp32)` is `linear(x, segments, bias, ...)` at a
    microsecond less Python per call (decode calls every layer's weights once a token)."""

    __slots__ = ("_args", "_bias", "_swiglu")

    def __init__(self, segments: Sequence[PackedQuant], bias: torch.Tensor | None = None) -> None:
        if not segments:
            raise ValueError("a weight needs at least one segment")
        swiglu = segments[0].swiglu
        if swiglu and len(segments) > 1:
            raise ValueError("a SwiGLU weight is a single segment")
        self._args = (
            [s.values for s in segments],
            [s.scales for s in segments],
            [s.qtype for s in segments],
            [s.rows for s in segments],
        )
        self._bias = bias
        self._swiglu = swiglu

    def __call__(self, x: torch.Tensor, out_fp32: bool = False) -> torch.Tensor:
        # The op of the variant in use, looked up per call (tests switch variants).
        return op("quant_linear")(x, *self._args, self._bias, self._swiglu, out_fp32)

    def arguments(self) -> tuple[list, list, list[int], list[int], torch.Tensor | None, bool]:
        """`quant_linear`'s arguments after x, before out_fp32: (values, scales, qtypes, rows,
        bias, swiglu), for callers that bind the op natively (models/decode_plan.py)."""
        values, scales, qtypes, rows = self._args
        return values, scales, [int(q) for q in qtypes], rows, self._bias, self._swiglu


def raw_rows(packed: PackedQuant, index: torch.Tensor) -> torch.Tensor:
    """Rows `index` (1-D, of the original weight) as GGUF stores them: uint8 `[len, row_bytes]`."""
    return ops().quant_unpack(
        packed.values, packed.scales, packed.qtype, packed.cols, packed.rows, packed.swiglu, index
    )


# Types whose rows `dequantize_rows` gives natively (one product d * (q - offset) per value).
DEQUANT_NATIVE = (Q8_0, Q4_0, Q5_0)


def dequantize_rows(packed: PackedQuant, index: torch.Tensor) -> torch.Tensor:
    """Rows `index` (1-D) as float32 `[len, cols]`, dequantized straight from the tiles (a
    `DEQUANT_NATIVE` type): the bits of the reference dequantizer on `raw_rows`."""
    return ops().quant_dequant_rows(
        packed.values, packed.scales, packed.qtype, packed.cols, packed.rows, packed.swiglu, index
    )


def quantizes(qtype: int) -> bool:
    """Whether `quantize_k` quantizes `qtype` here (Q4_K, Q5_K, Q6_K where the kernels run)."""
    return int(qtype) in (Q4_K, Q5_K, Q6_K) and available()


def quantize_k(blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """float32 super-blocks `[n, 256]` → Q4_K / Q5_K / Q6_K blocks `[n, block_bytes]` (uint8), the
    bytes of `pagoda.quant.quantize`'s PyTorch quantizer (`csrc/quant_kquant.cpp`)."""
    return ops().quant_quantize_k(blocks, int(qtype))


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`x: [M, K]` (float32 or bfloat16) → (int8 values, float32 block scales, int32 block sums):
    the 8-bit activations `linear` multiplies (tests compare against them)."""
    return ops().quant_act_q8(x.contiguous())


def dot_kind() -> str:
    """Which integer dot product the kernels use on this CPU (avx512_vnni, avx512_maddubs,
    avx_vnni or avx2_maddubs)."""
    return ops().quant_dot_kind()


def dot_kinds() -> list[str]:
    """Every integer dot product the kernel variant in use can run on this CPU, fastest first."""
    return list(ops().quant_dot_kinds())


@contextlib.contextmanager
def use_dot(name: str) -> Iterator[None]:
    """Run the kernels on dot product `name` inside the block (tests; not thread-safe)."""
    previous = dot_kind()
    ops().quant_use_dot(name)
    try:
        yield
    finally:
        ops().quant_use_dot(previous)
