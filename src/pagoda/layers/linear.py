"""Linear layers whose parameters know how to load themselves from checkpoint tensors.

`PackedLinear` fuses several checkpoint projections into one GEMM (q/k/v → qkv_proj,
gate/up → gate_up_proj): each checkpoint tensor names its shard and is copied into its rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.kernels import cpu_gemv
from pagoda.layers.precision import upcast_to_fp32

ShardId = str | int


def _copy_checked(target: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
    if tuple(target.shape) != tuple(loaded.shape):
        raise ValueError(f"{what}: checkpoint shape {tuple(loaded.shape)} != expected {tuple(target.shape)}")
    target.copy_(loaded)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    """Copy a whole checkpoint tensor into `param` (casting dtype and device)."""
    _copy_checked(param.data, loaded, "parameter")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear`, with a bandwidth-bound kernel for a few bf16 rows on the CPU (decode), and in
    float32 where that is faster for many rows (see `pagoda.layers.precision`)."""
    if x.shape[0] <= cpu_gemv.MAX_M:
        return cpu_gemv.linear(x, weight, bias)  # F.linear where the kernel does not apply
    if upcast_to_fp32(x, x.shape[0]):
        return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)
    return F.linear(x, weight, bias)


def new_parameter(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    param = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    param.weight_loader = default_weight_loader
    return param


class Linear(nn.Module):
    """`y = x W^T + b` with plain (unpacked) parameters."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = new_parameter(out_features, in_features, dtype=dtype)
        self.bias = new_parameter(out_features, dtype=dtype) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class PackedLinear(nn.Module):
    """Several projections of the same input stacked along the output dimension.

    `shards` lists `(shard_id, out_features)` in output order; the checkpoint tensor for shard
    `shard_id` fills rows `offset:offset + out_features` of the weight (and bias).
    """

    def __init__(
        self,
        in_features: int,
        shards: Sequence[tuple[ShardId, int]],
        bias: bool,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        if not shards:
            raise ValueError("PackedLinear needs at least one shard")
        self.in_features = in_features
        self.shard_slices: dict[ShardId, tuple[int, int]] = {}
        offset = 0
        for shard_id, size in shards:
            if shard_id in self.shard_slices:
                raise ValueError(f"duplicate shard id {shard_id!r}")
            self.shard_slices[shard_id] = (offset, size)
            offset += size
        self.out_features = offset
        self.output_sizes = [size for _, size in shards]
        self.weight = self._packed_parameter(offset, in_features, dtype=dtype)
        self.bias = self._packed_parameter(offset, dtype=dtype) if bias else None

    def _packed_parameter(self, *shape: int, dtype: torch.dtype) -> nn.Parameter:
        param = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
        param.weight_loader = self.weight_loader
        param.shard_ids = tuple(self.shard_slices)
        return param

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId) -> None:
        if shard_id not in self.shard_slices:
            raise ValueError(f"unknown shard {shard_id!r}; expected one of {list(self.shard_slices)}")
        offset, size = self.shard_slices[shard_id]
        _copy_checked(param.data.narrow(0, offset, size), loaded, f"shard {shard_id!r}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
