"""Linear layers whose parameters know how to load themselves from checkpoint tensors.

`PackedLinear` fuses several checkpoint projections into one GEMM (q/k/v → qkv_proj,
gate/up → gate_up_proj): each checkpoint tensor names its shard and is copied into its rows.
Weights come in the weight format in effect while the layer is built (`pagoda.quant.methods`:
dense float, a GGUF file's tensors, or quantized at load). After loading,
`process_weights_after_loading` hands the weight to its format: one that stays quantized becomes
a `QuantLinear`; a dense bf16 CPU weight is repacked for the native kernel
(`pagoda.kernels.cpu_gemm`) where it runs. Either then replaces the `weight` and `bias` parameters
as the layer's `packed` weight.

Tensor parallelism (the shard hook): a layer may hold only part of a checkpoint tensor, given as
`source_rows` (per shard id, the rows it takes) or `source_cols`; its loader cuts that part out
(`pagoda.layers.sharding.narrow`, which reads only those bytes of a safetensors file). The
column- and row-parallel layers built on these are in `pagoda.layers.parallel`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.distributed import SINGLE, ParallelGroup, even_split
from pagoda.kernels import cpu_gemm
from pagoda.kernels.precision import upcast_to_fp32
from pagoda.layers.sharding import CheckpointTensor, materialize, narrow
from pagoda.quant.linear import QuantLinear
from pagoda.quant.methods import current_weight_format, is_placeholder, load_rows
from pagoda.quant.tensor import GGMLTensor

ShardId = str | int


def default_weight_loader(param: nn.Parameter, loaded: CheckpointTensor) -> None:
    """Copy a whole checkpoint tensor into `param` (casting dtype and device); a weight in a
    GGUF placeholder keeps it as it is."""
    loaded = materialize(loaded)
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
    """`y = x W^T + b` with plain (unfused) parameters.

    `source_cols = (start, in_features)`: the weight is that column range of the checkpoint's
    (a row-parallel shard); the bias is whole."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        source_cols: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = weight_parameter(out_features, in_features, dtype)
        self.bias = new_parameter(out_features, dtype=dtype) if bias else None
        if source_cols is not None:
            if source_cols[1] != in_features:
                raise ValueError(f"source_cols {source_cols} must take in_features={in_features} columns")
            self.source_cols = source_cols
            self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor) -> None:
        start, length = self.source_cols
        default_weight_loader(param, narrow(loaded, 1, start, length, "columns"))


class PackedLinear(LinearBase):
    """Several projections of the same input stacked along the output dimension.

    `shards` lists `(shard_id, out_features)` in output order; the checkpoint tensor for shard
    `shard_id` fills rows `offset:offset + out_features` of the weight (and bias). With
    `source_rows[shard_id] = (start, out_features)` it fills them from that row range of the
    checkpoint tensor (a column-parallel shard); without, from the whole tensor.
    """

    def __init__(
        self,
        in_features: int,
        shards: Sequence[tuple[ShardId, int]],
        bias: bool,
        dtype: torch.dtype,
        source_rows: Mapping[ShardId, tuple[int, int]] | None = None,
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
        self.source_rows = dict(source_rows or {})
        for shard_id, (_, length) in self.source_rows.items():
            if shard_id not in self.shard_slices or self.shard_slices[shard_id][1] != length:
                raise ValueError(f"source rows of shard {shard_id!r} must match its output size")
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

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor, shard_id: ShardId) -> None:
        if shard_id not in self.shard_slices:
            raise ValueError(f"unknown shard {shard_id!r}; expected one of {list(self.shard_slices)}")
        offset, size = self.shard_slices[shard_id]
        what = f"shard {shard_id!r}"
        source = self.source_rows.get(shard_id)
        loaded = materialize(loaded) if source is None else narrow(loaded, 0, *source, what)
        load_rows(param, loaded, offset, size, what)


class GateUpLinear(PackedLinear):
    """The `[gate | up]` projection of a gated MLP, applied as `silu(gate) * up`; the kernel
    fuses the activation into the GEMM."""

    _swiglu = True

    def __init__(
        self,
        in_features: int,
        intermediate_size: int,
        bias: bool,
        dtype: torch.dtype,
        tp: ParallelGroup = SINGLE,
    ) -> None:
        """Column-parallel over `tp`: each rank holds its part of the gate and of the up rows."""
        start, local = even_split(intermediate_size, tp.rank, tp.size, "intermediate_size")
        rows = {0: (start, local), 1: (start, local)} if tp.size > 1 else None
        super().__init__(in_features, [(0, local), (1, local)], bias, dtype, source_rows=rows)
        self.intermediate_size = local

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`silu(x G^T + b_g) * (x U^T + b_u)`, `[..., intermediate_size]`."""
        if self.packed is not None:
            return apply_packed(x, self.packed)
        gate_up = linear(x, self.weight, self.bias)
        return F.silu(gate_up[..., : self.intermediate_size]) * gate_up[..., self.intermediate_size :]
