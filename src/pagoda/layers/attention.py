"""The attention layer: binds one layer's KV cache to a backend instance."""

from __future__ import annotations

import torch
from torch import nn

from pagoda.attention.backend import AttentionBackend
from pagoda.attention.metadata import AttentionMetadata


class Attention(nn.Module):
    def __init__(
        self,
        backend_cls: type[AttentionBackend],
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.impl = backend_cls(num_heads, num_kv_heads, head_dim, scale, sliding_window)
        # Owned by the model runner; a plain attribute so it never enters the state dict.
        self.kv_cache: torch.Tensor | None = None

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        if self.kv_cache is None:
            raise RuntimeError("no KV cache bound to this attention layer; call model.bind_kv_cache first")
        return self.impl.forward(q, k, v, self.kv_cache, attn_metadata)
