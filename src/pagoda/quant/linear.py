"""`QuantLinear`: the multiply of a linear layer whose weight stays in GGML blocks.

The weight is a list of row segments, one `GGMLTensor` each: a fused projection whose parts come
in different types (Q4_K_M stores some `attn_v` as Q6_K next to a Q4_K `attn_q`) keeps one
segment per run of equal types.

Q8_0, Q4_0, Q5_0, Q4_K and Q6_K segments go to the integer kernels (`pagoda.kernels.cpu_quant`;
Q8_0 and Q4_0 repacked once, the others read as stored) where they run: up to `INTEGER_MAX_ROWS` rows multiply with 8-bit activations and integer dot
products (one row is bound by memory bandwidth, a batch by arithmetic); more rows take the
dequantized float32 weight and `F.linear`. Every other type, and every type where the
kernels do not run, takes the reference: dequantize to float32 and `F.linear`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from pagoda.kernels import cpu_quant
from pagoda.quant.formats import GGMLType
from pagoda.quant.tensor import GGMLTensor

# Rows up to which the integer kernel beats dequantize + fp32 GEMM. Measured on an AMD EPYC
# (Zen 4, 2 threads, Q8_0 9728 x 896): 1 row 0.22 against 34.4 ms, 64 rows 7.3 against 38.4 ms,
# 256 rows 31.1 against 63.5 ms (the dequantization costs ~34 ms a call; the integer kernel
# ~0.12 ms a row); a 2,048-token prefill of Qwen2.5-0.5B's shape took 14.6 s on the float path
# against 9.0 s for bf16. So every row count the engine schedules takes the integer kernel.
INTEGER_MAX_ROWS = 4096


def merge_runs(parts: Sequence[GGMLTensor]) -> list[GGMLTensor]:
    """Concatenate neighbouring row segments of the same type."""
    merged: list[list[GGMLTensor]] = []
    for part in parts:
        if merged and merged[-1][0].qtype == part.qtype:
            merged[-1].append(part)
        else:
            merged.append([part])
    return [GGMLTensor.cat(run) for run in merged]


class QuantLinear:
    """`x @ W.T + b` (or `silu(gate) * up` when `swiglu`, W = [gate; up]) over GGML segments."""

    def __init__(self, segments: Sequence[GGMLTensor], bias: torch.Tensor | None, swiglu: bool) -> None:
        if not segments:
            raise ValueError("a quantized weight needs at least one segment")
        cols = {seg.shape[1] for seg in segments}
        if len(cols) != 1:
            raise ValueError(f"segments of one weight must share their width, got {sorted(cols)}")
        rows = sum(seg.shape[0] for seg in segments)
        if swiglu and rows % 2:
            raise ValueError(f"a gate/up weight needs an even number of rows, got {rows}")
        if bias is not None and tuple(bias.shape) != (rows,):
            raise ValueError(f"bias must have shape ({rows},), got {tuple(bias.shape)}")
        self.in_features = cols.pop()
        self.rows = rows
        self.swiglu = swiglu
        self.out_features = rows // 2 if swiglu else rows
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.segments = merge_runs(segments)
        # The kernels' layout replaces a segment's raw rows (the same bytes, no second copy).
        self.packed: list[cpu_quant.PackedQuant | None] = []
        for index, seg in enumerate(self.segments):
            if not cpu_quant.supports(seg.qtype, seg.shape[1]):
                self.packed.append(None)
                continue
            packed = cpu_quant.pack(seg.qtype, seg.data, seg.shape[1])
            self.packed.append(packed)
            if not packed.raw:
                self.segments[index] = GGMLTensor(seg.qtype, seg.data[:0], (0, seg.shape[1]))
        self.segment_rows = [
            p.rows if p is not None else seg.shape[0]
            for seg, p in zip(self.segments, self.packed, strict=True)
        ]

    @property
    def qtypes(self) -> list[GGMLType]:
        return [seg.qtype for seg in self.segments]

    def values_by_type(self) -> dict[str, int]:
        """Weight values per storage type."""
        counts: dict[str, int] = {}
        for seg, rows in zip(self.segments, self.segment_rows, strict=True):
            counts[seg.qtype.name] = counts.get(seg.qtype.name, 0) + rows * self.in_features
        return counts

    def describe(self) -> str:
        return "+".join(dict.fromkeys(t.name for t in self.qtypes))

    @property
    def nbytes(self) -> int:
        weights = sum(
            p.nbytes if p is not None else seg.nbytes
            for seg, p in zip(self.segments, self.packed, strict=True)
        )
        return weights + (0 if self.bias is None else self.bias.numel() * 4)

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """`x: [..., in_features]` (float) → `[..., out_features]` in `out_dtype` (default x's)."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x has {x.shape[-1]} features, the weight expects {self.in_features}")
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.in_features)
        integer = flat.shape[0] <= INTEGER_MAX_ROWS
        quantized = None
        outs = []
        for seg, packed in zip(self.segments, self.packed, strict=True):
            if packed is None or (packed.raw and not integer):
                outs.append(flat.float() @ seg.dequantize().t())
            elif integer:
                if quantized is None:  # x rounded to 8 bits once for every segment
                    quantized = cpu_quant.quantize_activations(flat)
                outs.append(cpu_quant.linear(flat, packed, quantized))
            else:
                outs.append(flat.float() @ cpu_quant.dequantize(packed).t())
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        if self.bias is not None:
            y = y + self.bias
        if self.swiglu:
            y = F.silu(y[:, : self.out_features]) * y[:, self.out_features :]
        return y.to(out_dtype or x.dtype).reshape(*lead, self.out_features)

    def dequantize(self) -> torch.Tensor:
        """The whole weight as float32 `[rows, in_features]` (reference and tests)."""
        return torch.cat(
            [
                cpu_quant.dequantize(p) if p is not None and not p.raw else seg.dequantize()
                for seg, p in zip(self.segments, self.packed, strict=True)
            ]
        )

    def gather_rows(self, index: torch.Tensor) -> torch.Tensor:
        """Weight rows `index` (any shape) as float32 `[*index.shape, in_features]`: an embedding
        lookup from a tied LM head's weight."""
        flat = index.reshape(-1)
        out = torch.empty(flat.numel(), self.in_features, dtype=torch.float32)
        start = 0
        for seg, packed, rows in zip(self.segments, self.packed, self.segment_rows, strict=True):
            hit = (flat >= start) & (flat < start + rows)
            if hit.any():
                local = flat[hit] - start
                if packed is not None and not packed.raw:
                    out[hit] = cpu_quant.dequantize_rows(packed, local)
                else:
                    out[hit] = seg.take_rows(local).dequantize()
            start += rows
        return out.reshape(*index.shape, self.in_features)
