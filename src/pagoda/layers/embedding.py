"""Token embedding and the language-model head (optionally sharing the embedding weight).

A tied pair shares one tensor: after loading, the head may repack it for the CPU kernel (or
keep it quantized), and the embedding then reads its rows from the head's copy (`use_packed`).
An untied embedding whose weight stays quantized dequantizes only the rows it looks up."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.kernels import cpu_gemm
from pagoda.layers.linear import LinearBase, apply_packed, linear, weight_parameter
from pagoda.quant.linear import QuantLinear
from pagoda.quant.methods import current_weight_format
from pagoda.quant.tensor import GGMLTensor


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight_format = current_weight_format()
        self.weight = weight_parameter(vocab_size, hidden_size, dtype)
        self.dtype = dtype
        self.packed: cpu_gemm.PackedWeight | QuantLinear | None = None
        self.quantized: GGMLTensor | None = None

    def process_weights_after_loading(self) -> None:
        if self.weight is None:
            return
        self.quantized = self.weight_format.process_embedding(self.weight)
        if self.quantized is not None:
            self.weight = None  # a tied LM head keeps its own reference until it is processed

    def use_packed(self, packed: cpu_gemm.PackedWeight | QuantLinear) -> None:
        """Read rows from a tied LM head's packed (or quantized) copy of this weight, and drop the weight."""
        self.packed = packed
        self.weight = None
        self.quantized = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.packed, QuantLinear):
            return self.packed.gather_rows(input_ids).to(self.dtype)
        if self.packed is not None:
            return cpu_gemm.gather_rows(self.packed, input_ids)
        if self.quantized is not None:
            rows = self.quantized.take_rows(input_ids.reshape(-1)).dequantize().to(self.dtype)
            return rows.reshape(*input_ids.shape, self.quantized.shape[1])
        return F.embedding(input_ids, self.weight)


class LMHead(LinearBase):
    """Hidden states → float32 logits. Pass `tied_weight` to share the embedding matrix."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        dtype: torch.dtype,
        tied_weight: nn.Parameter | None = None,
    ) -> None:
        super().__init__()
        if tied_weight is not None:
            shape = tuple(getattr(tied_weight, "logical_shape", tied_weight.shape))  # a GGUF placeholder's
            if shape != (vocab_size, hidden_size):
                raise ValueError(f"tied weight shape {shape} != {(vocab_size, hidden_size)}")
            self.weight = tied_weight
        else:
            self.weight = weight_parameter(vocab_size, hidden_size, dtype)
        self.bias = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return apply_packed(hidden, self.packed, out_dtype=torch.float32)
        return linear(hidden, self.weight, None).float()
