"""Token embedding and the language-model head (optionally sharing the embedding weight).

A tied pair shares one tensor: after loading, the head may repack it for the CPU kernel, and
the embedding then reads its rows from the packed copy (`use_packed`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.kernels import cpu_gemm
from pagoda.layers.linear import LinearBase, linear, new_parameter


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = new_parameter(vocab_size, hidden_size, dtype=dtype)
        self.packed: cpu_gemm.PackedWeight | None = None

    def use_packed(self, packed: cpu_gemm.PackedWeight) -> None:
        """Read rows from a tied LM head's packed copy of this weight, and drop the weight."""
        self.packed = packed
        self.weight = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return cpu_gemm.gather_rows(self.packed, input_ids)
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
            if tuple(tied_weight.shape) != (vocab_size, hidden_size):
                raise ValueError(
                    f"tied weight shape {tuple(tied_weight.shape)} != {(vocab_size, hidden_size)}"
                )
            self.weight = tied_weight
        else:
            self.weight = new_parameter(vocab_size, hidden_size, dtype=dtype)
        self.bias = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return cpu_gemm.linear(hidden, self.packed, out_dtype=torch.float32)
        return linear(hidden, self.weight, None).float()
