"""What a loaded model's weights are stored as, and how many bytes they hold in memory."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagoda.kernels import cpu_gemm
from pagoda.layers.embedding import VocabEmbedding
from pagoda.layers.linear import LinearBase
from pagoda.quant.linear import QuantLinear

_DTYPE_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


@dataclass(frozen=True)
class WeightReport:
    nbytes: int  # every weight the model holds (quantized, packed or dense), counted once
    type_shares: dict[str, float]  # storage type → share of the weight-matrix values

    def describe(self) -> str:
        mix = ", ".join(f"{name} {100 * share:.0f}%" for name, share in self.type_shares.items())
        return f"{mix}; {self.nbytes / 2**20:.1f} MiB of weights"


def weight_report(model: nn.Module) -> WeightReport:
    seen: set[int] = set()
    values: dict[str, int] = {}
    nbytes = 0

    def count(obj: object, size: int) -> int:
        if id(obj) in seen:
            return 0
        seen.add(id(obj))
        return size

    for module in model.modules():
        if not isinstance(module, LinearBase | VocabEmbedding):
            continue
        packed, quantized = module.packed, getattr(module, "quantized", None)
        if isinstance(packed, QuantLinear):
            added = count(packed, packed.nbytes)
            if added:
                for name, count_ in packed.values_by_type().items():
                    values[name] = values.get(name, 0) + count_
            nbytes += added
        elif isinstance(packed, cpu_gemm.PackedWeight):
            size = packed.data.numel() * packed.data.element_size()
            size += 0 if packed.bias is None else packed.bias.numel() * 4
            added = count(packed, size)
            if added:
                rows = packed.out_features * (2 if packed.swiglu else 1)
                name = _DTYPE_NAMES.get(packed.dtype, str(packed.dtype))
                values[name] = values.get(name, 0) + rows * packed.in_features
            nbytes += added
        elif quantized is not None:
            added = count(quantized, quantized.nbytes)
            if added:
                values[quantized.qtype.name] = (
                    values.get(quantized.qtype.name, 0) + quantized.shape[0] * quantized.shape[1]
                )
            nbytes += added
        elif module.weight is not None and module.weight.dim() == 2:
            w = module.weight
            added = count(w, w.numel() * w.element_size())
            if added:
                name = _DTYPE_NAMES.get(w.dtype, str(w.dtype))
                values[name] = values.get(name, 0) + w.numel()
            nbytes += added
    for param in model.parameters():  # norms, biases of unpacked layers
        nbytes += count(param, param.numel() * param.element_size())
    total = sum(values.values()) or 1
    shares = {name: n / total for name, n in sorted(values.items(), key=lambda kv: -kv[1])}
    return WeightReport(nbytes, shares)
