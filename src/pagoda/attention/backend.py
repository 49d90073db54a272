"""The attention backend interface and a registry of implementations.

A backend owns the layout of the paged KV cache (one tensor per layer) and computes attention for
a flat batch described by `AttentionMetadata`. The model builds one backend instance per attention
layer, so per-layer constants (head counts, scale, sliding window) live on the instance.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from pagoda.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    """Paged attention for one layer.

    Inputs are `q: [T, num_heads, head_dim]`, `k` and `v: [T, num_kv_heads, head_dim]` (views with
    any strides along the token dimension are fine), and the output is `[T, num_heads, head_dim]`.
    """

    name: str = ""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
    ) -> None:
        if num_heads <= 0 or num_kv_heads <= 0 or head_dim <= 0:
            raise ValueError(
                f"attention needs positive head counts and head_dim, got num_heads={num_heads}, "
                f"num_kv_heads={num_kv_heads}, head_dim={head_dim}"
            )
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive or None, got {sliding_window}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        # A query at position p sees keys at positions p - sliding_window + 1 ... p (HF semantics).
        self.sliding_window = sliding_window

    @staticmethod
    @abstractmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """Shape of one layer's KV cache tensor."""

    @classmethod
    def allocate_kv_cache(
        cls,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> torch.Tensor:
        """One layer's cache, zero-filled: slots that were never written must hold finite values,
        because padded reads are masked after the matmul, not before."""
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks} and {block_size}")
        shape = cls.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)
        return torch.zeros(shape, dtype=dtype, device=device)

    @staticmethod
    @abstractmethod
    def copy_blocks(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole blocks `src[i]` to `dst[i]` in one layer's cache (copy-on-write)."""

    @abstractmethod
    def write_kv(
        self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Store this step's keys and values at their cache slots."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Write `k`/`v` into the cache, then attend each query over its sequence's cached context."""


_BACKENDS: dict[str, type[AttentionBackend]] = {}


def register_attention_backend(
    name: str,
) -> Callable[[type[AttentionBackend]], type[AttentionBackend]]:
    """Class decorator adding a backend to the registry under `name`."""

    def register(cls: type[AttentionBackend]) -> type[AttentionBackend]:
        if name in _BACKENDS and _BACKENDS[name] is not cls:
            raise ValueError(f"attention backend {name!r} is already registered")
        cls.name = name
        _BACKENDS[name] = cls
        return cls

    return register


def available_attention_backends() -> list[str]:
    return sorted(_BACKENDS)


def get_attention_backend(name: str = "torch") -> type[AttentionBackend]:
    """The backend class registered under `name`."""
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"unknown attention backend {name!r}; available: {', '.join(available_attention_backends())}"
        ) from None
