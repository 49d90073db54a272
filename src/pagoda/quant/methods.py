"""Weight formats: how a layer's weight matrix is created, loaded and turned into what it multiplies.

The model code is the same for every format. Its linear and embedding layers ask the format in
effect while the model is built (`use_weight_format`, set by the loader) for their weight
parameter, and hand the loaded parameter back to it after loading:

- `DenseFormat` (safetensors; the default): a float parameter the checkpoint is copied into.
- `GGUFFormat` (a GGUF file): an empty placeholder whose loader keeps each checkpoint tensor as
  it is in the file (`GGMLTensor`, quantized or not), at its row offset. Float tensors (F32, F16,
  BF16) then become the dense parameter in the model's dtype; quantized ones stay quantized.
- `LoadTimeFormat` (`quantization="q8_0"` on a float checkpoint): a float parameter, quantized
  after loading.

`process_linear` returns a `QuantLinear` for a weight that stays quantized, or None when the
parameter holds a dense float weight (the layer's usual path, its kernels included).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
from torch import nn

from pagoda.quant.formats import LOAD_TIME_TYPES, GGMLType, with_fallback
from pagoda.quant.linear import QuantLinear
from pagoda.quant.tensor import GGMLTensor

# A placeholder parameter's loaded parts: (first row, tensor) in load order.
_PARTS_ATTR = "ggml_parts"


class WeightFormat:
    """Dense float weights: the parameter is the weight."""

    name = "dense"

    def weight_parameter(self, rows: int, cols: int, dtype: torch.dtype) -> nn.Parameter:
        return nn.Parameter(torch.empty(rows, cols, dtype=dtype), requires_grad=False)

    def process_linear(
        self, weight: nn.Parameter, bias: torch.Tensor | None, swiglu: bool
    ) -> QuantLinear | None:
        return None

    def process_embedding(self, weight: nn.Parameter) -> GGMLTensor | None:
        return None


DenseFormat = WeightFormat


class GGUFFormat(WeightFormat):
    """Weights as a GGUF file stores them (see the module docstring)."""

    name = "gguf"

    def weight_parameter(self, rows: int, cols: int, dtype: torch.dtype) -> nn.Parameter:
        param = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)
        param.logical_shape = (rows, cols)
        setattr(param, _PARTS_ATTR, [])
        return param

    def process_linear(
        self, weight: nn.Parameter, bias: torch.Tensor | None, swiglu: bool
    ) -> QuantLinear | None:
        parts = _take_parts(weight)
        if parts is None or all(p.is_float for _, p in parts):
            return None
        return QuantLinear([p for _, p in parts], bias, swiglu)

    def process_embedding(self, weight: nn.Parameter) -> GGMLTensor | None:
        parts = _take_parts(weight)
        if parts is None or all(p.is_float for _, p in parts):
            return None
        return GGMLTensor.cat([p for _, p in parts])


class LoadTimeFormat(WeightFormat):
    """Float weights quantized to `qtype` after loading (llama.cpp's fallback where a row does not
    fit the type's blocks; rows that fit no block type stay dense)."""

    def __init__(self, qtype: GGMLType) -> None:
        self.qtype = qtype
        self.name = qtype.name.lower()

    def _quantized(self, weight: nn.Parameter) -> GGMLTensor | None:
        """The weight in this format, or None where it stays dense. Kept on the parameter, so a
        tied embedding and LM head quantize it once."""
        qtype = with_fallback(self.qtype, weight.shape[1])
        if qtype == GGMLType.F16:
            return None
        cached = getattr(weight, "load_time_quantized", None)
        if cached is None or cached.qtype != qtype:
            cached = GGMLTensor.quantize(weight.data, qtype)
            weight.load_time_quantized = cached
        return cached

    def process_linear(
        self, weight: nn.Parameter, bias: torch.Tensor | None, swiglu: bool
    ) -> QuantLinear | None:
        quantized = self._quantized(weight)
        return None if quantized is None else QuantLinear([quantized], bias, swiglu)

    def process_embedding(self, weight: nn.Parameter) -> GGMLTensor | None:
        return self._quantized(weight)


def load_time_format(name: str) -> LoadTimeFormat:
    """The format for `quantization=name`; ValueError naming the choices."""
    qtype = LOAD_TIME_TYPES.get(name.lower()) if isinstance(name, str) else None
    if qtype is None:
        raise ValueError(f"unknown quantization {name!r}; choose one of {', '.join(LOAD_TIME_TYPES)}")
    return LoadTimeFormat(qtype)


# ---- loading into parameters ------------------------------------------------------------------------
def is_placeholder(param: torch.Tensor) -> bool:
    return hasattr(param, _PARTS_ATTR)


def load_rows(
    param: nn.Parameter, loaded: torch.Tensor | GGMLTensor, offset: int, size: int, what: str
) -> None:
    """Load `loaded` (`size` rows) into rows `offset:offset + size` of `param` (a weight or bias).

    A placeholder keeps the tensor as it comes; a dense parameter copies it (dequantized first if
    it is a GGMLTensor)."""
    if is_placeholder(param):
        _, cols = param.logical_shape
        if not isinstance(loaded, GGMLTensor):
            raise ValueError(f"{what}: a GGUF weight must come as a GGMLTensor, got {type(loaded).__name__}")
        if loaded.shape != (size, cols):
            raise ValueError(f"{what}: checkpoint shape {loaded.shape} != expected {(size, cols)}")
        getattr(param, _PARTS_ATTR).append((offset, loaded))
        return
    if isinstance(loaded, GGMLTensor):
        loaded = loaded.dequantize()
    target = param.data.narrow(0, offset, size)
    if tuple(target.shape) != tuple(loaded.shape):
        raise ValueError(f"{what}: checkpoint shape {tuple(loaded.shape)} != expected {tuple(target.shape)}")
    target.copy_(loaded)


def _take_parts(param: nn.Parameter) -> list[tuple[int, GGMLTensor]] | None:
    """A placeholder's parts in row order, checked to tile its rows; float-only parts become the
    parameter's dense data in place (so a tied embedding and LM head keep sharing it). None once
    the parameter is dense (never a placeholder, or already processed)."""
    if not is_placeholder(param):
        return None
    parts = sorted(getattr(param, _PARTS_ATTR), key=lambda item: item[0])
    total, _ = param.logical_shape
    covered = 0
    for offset, part in parts:
        if offset != covered:
            raise ValueError(f"weight rows {covered}..{offset} were not loaded")
        covered += part.shape[0]
    if covered != total:
        raise ValueError(f"weight has {covered} of its {total} rows loaded")
    if all(p.is_float for _, p in parts):
        param.data = torch.cat([p.dequantize() for _, p in parts]).to(param.dtype)
        delattr(param, _PARTS_ATTR)
        del param.logical_shape
        return parts
    return parts


# ---- the format in effect while a model is built ----------------------------------------------------
_DENSE = WeightFormat()
_CURRENT: contextvars.ContextVar[WeightFormat | None] = contextvars.ContextVar("weight_format", default=None)


def current_weight_format() -> WeightFormat:
    return _CURRENT.get() or _DENSE


@contextlib.contextmanager
def use_weight_format(fmt: WeightFormat) -> Iterator[None]:
    """Layers built inside this block take their weights in `fmt`."""
    token = _CURRENT.set(fmt)
    try:
        yield
    finally:
        _CURRENT.reset(token)
