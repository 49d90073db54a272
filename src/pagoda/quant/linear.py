"""`QuantLinear`: the multiply of a linear layer whose weight stays in GGML blocks.

The weight is a list of row segments, one `GGMLTensor` each: a fused projection whose parts come
in different types (Q4_K_M stores some `attn_v` as Q6_K next to a Q4_K `attn_q`) keeps one
segment per run of equal types.

Where the integer kernels run (`pagoda.kernels.cpu_quant`: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K,
Q5_K, Q6_K) every segment is repacked once into their tiled layout, which replaces the file's
rows (the same bytes, so memory stays the file's size), and every call takes one kernel call per
layer, whatever its row count: x quantized to 8 bits once for all segments, integer dot
products, then the bias, SwiGLU (`silu(gate) * up` for a single gate/up segment) and the output
dtype in the same call. Measured on an AMD EPYC (Zen 4, 1 thread, a 4864 x 896 layer) the
integer kernel is 3.2-3.6x faster than dequantizing to float32 and multiplying at 2,048 and
4,096 rows (and faster than pagoda's bf16 kernel at every row count), so no row count takes the
dequantizing path while a kernel runs. Other types (F16 parts) and everything where the kernels
do not run take the reference: dequantize to float32 and `F.linear`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from pagoda.kernels import cpu_quant
from pagoda.quant.formats import GGMLType
from pagoda.quant.tensor import GGMLTensor


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
        merged = merge_runs(segments)
        # Each segment is either repacked for the kernels (its file rows dropped) or kept as is.
        self.parts: list[GGMLTensor | cpu_quant.PackedQuant] = list(merged)
        self.qtypes: list[GGMLType] = [seg.qtype for seg in merged]
        self.segment_rows = [seg.shape[0] for seg in merged]
        if all(cpu_quant.supports(seg.qtype, self.in_features) for seg in merged):
            fused_swiglu = swiglu and len(merged) == 1  # tiles in (gate, up) pairs
            self.parts = [
                cpu_quant.pack(seg.qtype, seg.data, self.in_features, fused_swiglu) for seg in merged
            ]
        self.fused = all(isinstance(p, cpu_quant.PackedQuant) for p in self.parts) and (
            not swiglu or len(self.parts) == 1
        )
        # One kernel call for the whole layer, its arguments gathered here once.
        self._kernel = cpu_quant.Stack(self.parts, self.bias) if self.fused else None

    def kernel_arguments(self) -> tuple | None:
        """The fused kernel op's arguments (`cpu_quant.Stack.arguments`), or None where this
        layer does not run as one kernel call."""
        return self._kernel.arguments() if self._kernel is not None else None

    def values_by_type(self) -> dict[str, int]:
        """Weight values per storage type."""
        counts: dict[str, int] = {}
        for qtype, rows in zip(self.qtypes, self.segment_rows, strict=True):
            counts[qtype.name] = counts.get(qtype.name, 0) + rows * self.in_features
        return counts

    def describe(self) -> str:
        return "+".join(dict.fromkeys(t.name for t in self.qtypes))

    @property
    def nbytes(self) -> int:
        weights = sum(p.nbytes for p in self.parts)
        return weights + (0 if self.bias is None else self.bias.numel() * 4)

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """`x: [..., in_features]` (float) → `[..., out_features]` in `out_dtype` (default x's)."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x has {x.shape[-1]} features, the weight expects {self.in_features}")
        out_dtype = out_dtype or x.dtype
        if self._kernel is not None:
            # The decode path: a few attribute checks around one kernel call.
            flat = x if x.dim() == 2 else x.reshape(-1, self.in_features)
            if flat.dtype is not torch.float32 and flat.dtype is not torch.bfloat16:
                flat = flat.float()
            y = self._kernel(flat, out_dtype is torch.float32)
            if y.dtype is not out_dtype:
                y = y.to(out_dtype)
            return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.in_features)
        outs = []
        for part in self.parts:
            if isinstance(part, cpu_quant.PackedQuant):
                outs.append(cpu_quant.linear(flat.float(), [part], out_dtype=torch.float32))
            else:
                outs.append(flat.float() @ _dequantize(part).t())
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        if self.bias is not None:
            y = y + self.bias
        if self.swiglu:
            y = F.silu(y[:, : self.out_features]) * y[:, self.out_features :]
        return y.to(out_dtype).reshape(*lead, self.out_features)

    def dequantize(self) -> torch.Tensor:
        """The whole weight as float32 `[rows, in_features]` (reference and tests)."""
        return torch.cat([_dequantize(p) for p in self.parts])

    def gather_rows(self, index: torch.Tensor) -> torch.Tensor:
        """Weight rows `index` (any shape) as float32 `[*index.shape, in_features]`: an embedding
        lookup from a tied LM head's weight."""
        flat = index.reshape(-1)
        if len(self.parts) == 1:  # one segment (the usual embedding): no masks
            return _dequantize(self.parts[0], flat).reshape(*index.shape, self.in_features)
        out = torch.empty(flat.numel(), self.in_features, dtype=torch.float32)
        start = 0
        for part, rows in zip(self.parts, self.segment_rows, strict=True):
            hit = (flat >= start) & (flat < start + rows)
            if hit.any():
                out[hit] = _dequantize(part, flat[hit] - start)
            start += rows
        return out.reshape(*index.shape, self.in_features)


def _dequantize(part: GGMLTensor | cpu_quant.PackedQuant, rows: torch.Tensor | None = None) -> torch.Tensor:
    """float32 rows `rows` (1-D; default all) of a segment, by the reference dequantizer."""
    if isinstance(part, cpu_quant.PackedQuant):
        if rows is not None and part.qtype in cpu_quant.DEQUANT_NATIVE:
            return cpu_quant.dequantize_rows(part, rows)  # a few embedding rows, natively
        index = torch.arange(part.rows) if rows is None else rows
        part = GGMLTensor(GGMLType(part.qtype), cpu_quant.raw_rows(part, index), (index.numel(), part.cols))
    elif rows is not None:
        part = part.take_rows(rows)
    return part.dequantize()
