"""`GGMLTensor`: a 2-D weight stored in one GGML type, as the raw bytes of its rows."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagoda.quant.dequant import dequantize
from pagoda.quant.formats import FLOAT_TYPES, GGMLType, check_supported, row_bytes
from pagoda.quant.quantize import quantize


@dataclass(frozen=True)
class GGMLTensor:
    """`shape = (rows, cols)` values stored as `data: uint8 [rows, row_bytes(qtype, cols)]`.

    Rows are independent runs of blocks, so selecting, permuting or concatenating rows works on
    the bytes without decoding them.
    """

    qtype: GGMLType
    data: torch.Tensor
    shape: tuple[int, int]

    def __post_init__(self) -> None:
        check_supported(self.qtype, "a weight")
        rows, cols = self.shape
        expected = (rows, row_bytes(self.qtype, cols))
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != expected:
            raise ValueError(
                f"{self.qtype.name} data for shape {self.shape} must be uint8 {expected}, "
                f"got {self.data.dtype} {tuple(self.data.shape)}"
            )

    @classmethod
    def quantize(cls, weight: torch.Tensor, qtype: GGMLType) -> GGMLTensor:
        if weight.dim() != 2:
            raise ValueError(f"only 2-D weights are quantized, got shape {tuple(weight.shape)}")
        return cls(qtype, quantize(weight, qtype), (weight.shape[0], weight.shape[1]))

    @property
    def is_float(self) -> bool:
        return self.qtype in FLOAT_TYPES

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def dequantize(self) -> torch.Tensor:
        """float32 `[rows, cols]`."""
        return dequantize(self.data, self.qtype)

    def take_rows(self, index: torch.Tensor) -> GGMLTensor:
        """Rows `index` (1-D) in that order."""
        return GGMLTensor(self.qtype, self.data.index_select(0, index), (index.numel(), self.shape[1]))

    @staticmethod
    def cat(parts: Sequence[GGMLTensor]) -> GGMLTensor:
        """Stack tensors of one type and width along the rows."""
        first = parts[0]
        if any(p.qtype != first.qtype or p.shape[1] != first.shape[1] for p in parts):
            raise ValueError("only tensors of one type and width can be stacked")
        if len(parts) == 1:
            return first
        data = torch.cat([p.data for p in parts])
        return GGMLTensor(first.qtype, data, (data.shape[0], first.shape[1]))
