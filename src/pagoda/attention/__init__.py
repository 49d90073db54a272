"""Attention metadata, the backend interface, and the registered backends."""

from pagoda.attention.backend import (
    AttentionBackend,
    available_attention_backends,
    get_attention_backend,
    register_attention_backend,
)
from pagoda.attention.metadata import AttentionMetadata
from pagoda.attention.torch_paged import TorchPagedAttention

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "TorchPagedAttention",
    "available_attention_backends",
    "get_attention_backend",
    "register_attention_backend",
]
