"""Megatron-style tensor-parallel linear layers (vLLM's QKV / row-parallel linear).

The attention's q/k/v projection is column-parallel (each rank holds its attention heads and its
KV heads, a KV head replicated where there are fewer of them than ranks); the o and down
projections are row-parallel: each rank multiplies its slice of the input features and one
all-reduce sums the parts, so every rank again holds the whole hidden state (one all-reduce after
each attention and each MLP block). The gate/up projection (`GateUpLinear`) and the vocabulary
(`pagoda.layers.embedding`) split the same way. With `SINGLE` these are the plain layers.
"""

from __future__ import annotations

import torch

from pagoda.distributed import SINGLE, ParallelGroup, even_split, kv_head_shard
from pagoda.layers.linear import Linear, PackedLinear, apply_packed, linear


class QKVParallelLinear(PackedLinear):
    """`[q | k | v]` of this rank's `num_heads` attention heads and `num_kv_heads` KV heads."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        bias: bool,
        dtype: torch.dtype,
        tp: ParallelGroup = SINGLE,
    ) -> None:
        q_first, q_heads = even_split(num_heads, tp.rank, tp.size, "num_attention_heads")
        kv_first, kv_heads = kv_head_shard(num_kv_heads, tp.rank, tp.size)
        self.num_heads, self.num_kv_heads = q_heads, kv_heads
        q_rows = (q_first * head_dim, q_heads * head_dim)
        kv_rows = (kv_first * head_dim, kv_heads * head_dim)
        super().__init__(
            hidden_size,
            [("q", q_rows[1]), ("k", kv_rows[1]), ("v", kv_rows[1])],
            bias=bias,
            dtype=dtype,
            source_rows={"q": q_rows, "k": kv_rows, "v": kv_rows} if tp.size > 1 else None,
        )


class RowParallelLinear(Linear):
    """`y = sum over ranks of x_r W_r^T, + b`: rank r holds input features `r * in / size ...`; the
    output is all-reduced (in float32, then cast to x's dtype) and whole on every rank."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        tp: ParallelGroup = SINGLE,
        what: str = "in_features",
    ) -> None:
        start, local = even_split(in_features, tp.rank, tp.size, what)
        super().__init__(
            local, out_features, bias, dtype, source_cols=(start, local) if tp.size > 1 else None
        )
        self.tp = tp

    def process_weights_after_loading(self) -> None:
        if not self.tp.is_first:
            self.bias = None  # added once, by rank 0, before the sum
        super().process_weights_after_loading()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(x)
        if self.packed is not None:
            partial = apply_packed(x, self.packed, out_dtype=torch.float32)
        else:
            partial = linear(x, self.weight, self.bias if self.tp.is_first else None).float()
        return self.tp.all_reduce(partial).to(x.dtype)
