"""RMSNorm with an optional fused residual add (numerics follow transformers); bf16 on the CPU
runs in one native kernel (`pagoda.kernels.cpu_ops`)."""

from __future__ import annotations

import torch
from torch import nn

from pagoda.kernels import cpu_ops
from pagoda.layers.linear import new_parameter


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = new_parameter(hidden_size, dtype=dtype)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in float32, then back to the activation dtype before the weight (as transformers).
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_ops.applies(x, self.weight):
            return cpu_ops.add_rms_norm(x, None, self.weight, self.eps)[0]
        return self._norm(x)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(norm(x + residual), x + residual)`: the sum becomes the next residual."""
        if cpu_ops.applies(x, residual, self.weight):
            return cpu_ops.add_rms_norm(x, residual, self.weight, self.eps)
        summed = residual + x
        return self._norm(summed), summed
