"""Linear layers whose parameters know how to load themselves from checkpoint tensors.

`PackedLinear` fuses several checkpoint projections into one GEMM (q/k/v → qkv_proj,
gate/up → gate_up_proj): each checkpoint tensor names its shard and is copied into its rows.
Weights come in the weight format in effect while the layer is built (`pagoda.quant.methods`:
dense float, a GGUF file's tensors, or quantized at load). After loading,
`process_weights_after_loading` hands the weight to its format: one that stays quantized becomes
a `QuantLinear`; a dense bf16 CPU weight is repacked for the native kernel
(`pagoda.kernels.cpu_gemm`) where it runs. Either then replaces the `weight` and `bias` parameters
as the layer's `packed` weight.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.kernels import cpu_gemm
from pagoda.kernels.precision import upcast_to_fp32
from pagoda.quant.linear import QuantLinear
from pagoda.quant.methods import current_weight_format, is_placeholder, load_rows
from pagoda.quant.tensor import GGMLTensor

ShardId = str | int


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    """Copy a whole checkpoint tensor into `param` (casting dtype and device); a weight in a
    GGUF placeholder keeps it as it is."""
    if is_placeholder(param):
        load_rows(param, loaded, 0, param.logical_shape[0], "parameter")
        return
    if isinstance(loaded, GGMLTensor):
        loaded = loaded.dequantize()
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(
            f"parameter: checkpoint shape {tuple(loaded.shape)} != expected {tuple(param.shape)}"
        )
    param.data.copy_(loaded)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear` on an unpacked weight, in float32 where that is faster for many bf16 rows
    (see `pagoda.kernels.precision`)."""
    if upcast_to_fp32(x, x.shape[0]):
        return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)
    return F.linear(x, weight, bias)


def new_parameter(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    param = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    param.weight_loader = default_weight_loader
    return param


def weight_parameter(rows: int, cols: int, dtype: torch.dtype) -> nn.Parameter:
    """A `[rows, cols]` weight matrix in the weight format in effect (see pagoda.quant.methods)."""
    param = current_weight_format().weight_parameter(rows, cols, dtype)
    param.weight_loader = default_weight_loader
    return param


def apply_packed(
    x: torch.Tensor, packed: cpu_gemm.PackedWeight | QuantLinear, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    if isinstance(packed, QuantLinear):
        return packed(x, out_dtype)
    return cpu_gemm.linear(x, packed, out_dtype=out_dtype)


class LinearBase(nn.Module):
    """`y = x W^T + b`; after loading, the weight may move into the kernel's packed layout."""

    # Pack a `[gate; up]` weight so that the kernel returns silu(gate) * up (see GateUpLinear).
    _swiglu = False
    packed: cpu_gemm.PackedWeight | QuantLinear | None = None

    def __init__(self) -> None:
        super().__init__()
        self.weight_format = current_weight_format()

    def process_weights_after_loading(self) -> None:
        if self.weight is None:
            return
        quantized = self.weight_format.process_linear(self.weight, self.bias, self._swiglu)
        if quantized is not None:
            self.packed = quantized
        elif cpu_gemm.applies_to(self.weight):
            self.packed = cpu_gemm.pack(self.weight, self.bias, swiglu=self._swiglu)
        else:
            return
        self.weight = None  # the packed (or quantized) weight replaces the parameters
        self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return apply_packed(x, self.packed)
        return linear(x, self.weight, self.bias)


class Linear(LinearBase):
    """`y = x W^T + b` with plain (unfused) parameters."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = weight_parameter(out_features, in_features, dtype)
        self.bias = new_parameter(out_features, dtype=dtype) if bias else None


class PackedLinear(LinearBase):
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
        self.weight = self._sharded(weight_parameter(offset, in_features, dtype))
        self.bias = (
            self._sharded(nn.Parameter(torch.empty(offset, dtype=dtype), requires_grad=False))
            if bias
            else None
        )

    def _sharded(self, param: nn.Parameter) -> nn.Parameter:
        param.weight_loader = self.weight_loader
        param.shard_ids = tuple(self.shard_slices)
        return param

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId) -> None:
        if shard_id not in self.shard_slices:
            raise ValueError(f"unknown shard {shard_id!r}; expected one of {list(self.shard_slices)}")
        offset, size = self.shard_slices[shard_id]
        load_rows(param, loaded, offset, size, f"shard {shard_id!r}")


class GateUpLinear(PackedLinear):
    """The `[gate | up]` projection of a gated MLP, applied as `silu(gate) * up`; the kernel
    fuses the activation into the GEMM."""

    _swiglu = True

    def __init__(self, in_features: int, intermediate_size: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__(in_features, [(0, intermediate_size), (1, intermediate_size)], bias, dtype)
        self.intermediate_size = intermediate_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`silu(x G^T + b_g) * (x U^T + b_u)`, `[..., intermediate_size]`."""
        if self.packed is not None:
            return apply_packed(x, self.packed)
        gate_up = linear(x, self.weight, self.bias)
        return F.silu(gate_up[..., : self.intermediate_size]) * gate_up[..., self.intermediate_size :]
