"""Token embedding and the language-model head (optionally sharing the embedding weight)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.layers.linear import linear, new_parameter


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = new_parameter(vocab_size, hidden_size, dtype=dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
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

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.weight, None).float()
