"""`QuantLinear`: the multiply of a linear layer whose weight stays in GGML blocks.

The weight is a list of row segments, one `GGMLTensor` each: a fused projection whose parts come
in different types (Q4_K_M stores some `attn_v` as Q6_K next to a Q4_K `attn_q`) keeps one
segment per run of equal types. Each segment is multiplied by the reference: dequantize to
float32 and `F.linear`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

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
        self.segments = merge_runs(segments)

    @property
    def qtypes(self) -> list[GGMLType]:
        return [seg.qtype for seg in self.segments]

    def describe(self) -> str:
        return "+".join(dict.fromkeys(t.name for t in self.qtypes))

    @property
    def nbytes(self) -> int:
        return sum(seg.nbytes for seg in self.segments) + (0 if self.bias is None else self.bias.numel() * 4)

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """`x: [..., in_features]` (float) → `[..., out_features]` in `out_dtype` (default x's)."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x has {x.shape[-1]} features, the weight expects {self.in_features}")
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.in_features)
        outs = [flat.float() @ seg.dequantize().t() for seg in self.segments]
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        if self.bias is not None:
            y = y + self.bias
        if self.swiglu:
            y = F.silu(y[:, : self.out_features]) * y[:, self.out_features :]
        return y.to(out_dtype or x.dtype).reshape(*lead, self.out_features)

    def dequantize(self) -> torch.Tensor:
        """The whole weight as float32 `[rows, in_features]` (reference and tests)."""
        return torch.cat([seg.dequantize() for seg in self.segments])

    def gather_rows(self, index: torch.Tensor) -> torch.Tensor:
        """Weight rows `index` (any shape) as float32 `[*index.shape, in_features]`: an embedding
        lookup from a tied LM head's weight."""
        flat = index.reshape(-1)
        out = torch.empty(flat.numel(), self.in_features, dtype=torch.float32)
        start = 0
        for seg in self.segments:
            rows = seg.shape[0]
            hit = (flat >= start) & (flat < start + rows)
            if hit.any():
                out[hit] = seg.take_rows(flat[hit] - start).dequantize()
            start += rows
        return out.reshape(*index.shape, self.in_features)
