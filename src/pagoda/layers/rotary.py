"""Rotary position embedding (rotate-half layout) with a precomputed cos/sin table.

Supported frequency schedules: `default` and `llama3` (Llama 3.1 long-context scaling); a
`default` schedule may divide each frequency by a factor (GGUF files store llama3 scaling as
these `rope_freqs` factors).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from pagoda.kernels import cpu_ops

SUPPORTED_ROPE_TYPES = ("default", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    # llama3 only:
    factor: float | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None
    # default only: inverse frequency i is divided by freq_factors[i] (one per rotated pair).
    freq_factors: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if not self.theta > 0:
            raise ValueError(f"rope theta must be positive, got {self.theta}")
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope type {self.rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        llama3_fields = {
            "factor": self.factor,
            "low_freq_factor": self.low_freq_factor,
            "high_freq_factor": self.high_freq_factor,
            "original_max_position_embeddings": self.original_max_position_embeddings,
        }
        if self.freq_factors is not None:
            if self.rope_type != "default":
                raise ValueError(f"rope type {self.rope_type!r} takes no freq_factors")
            if not self.freq_factors or not all(f > 0 for f in self.freq_factors):
                raise ValueError("rope freq_factors must be a non-empty list of positive numbers")
        if self.rope_type == "llama3":
            missing = [name for name, value in llama3_fields.items() if value is None]
            if missing:
                raise ValueError(f"llama3 rope scaling needs {', '.join(missing)}")
            nonpositive = [name for name, value in llama3_fields.items() if not value > 0]
            if nonpositive:
                raise ValueError(f"llama3 rope scaling needs positive {', '.join(nonpositive)}")
            if not self.high_freq_factor > self.low_freq_factor:
                raise ValueError(
                    f"llama3 rope scaling needs high_freq_factor ({self.high_freq_factor}) > "
                    f"low_freq_factor ({self.low_freq_factor})"
                )
        else:
            given = [name for name, value in llama3_fields.items() if value is not None]
            if given:
                raise ValueError(f"rope type {self.rope_type!r} takes no {', '.join(given)}")


def rope_inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """float32 `[head_dim // 2]` inverse frequencies, computed as transformers does."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if rope.freq_factors is not None:
        if len(rope.freq_factors) != head_dim // 2:
            raise ValueError(f"rope has {len(rope.freq_factors)} freq_factors for head_dim {head_dim}")
        return inv_freq / torch.tensor(rope.freq_factors, dtype=torch.float32)
    if rope.rope_type == "default":
        return inv_freq
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Looks up `(cos, sin)` for positions; `apply_rotary` rotates query/key heads with them."""

    def __init__(self, head_dim: int, max_position: int, rope: RopeConfig, dtype: torch.dtype) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}")
        self.head_dim = head_dim
        self.max_position = max_position
        inv_freq = rope_inverse_frequencies(rope, head_dim)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq.to(torch.float32))
        # [max_position, head_dim]: cos in the first half, sin in the second, in the model dtype.
        self.register_buffer(
            "cos_sin_cache", torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype), persistent=False
        )

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(cos, sin)`, each `[T, 1, head_dim // 2]`, broadcasting over heads."""
        cos, sin = self.cos_sin_cache.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)
        return cos, sin


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inplace: bool = False
) -> torch.Tensor:
    """Rotate `x: [T, heads, head_dim]` (rotate-half convention). Returns a new tensor, or with
    `inplace` may rotate x itself (bf16 on the CPU, in a native kernel)."""
    if inplace and x.stride(-1) == 1 and cpu_ops.applies(x, cos, sin):
        return cpu_ops.rotary_(x, cos, sin)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
