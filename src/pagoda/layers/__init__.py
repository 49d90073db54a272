"""Model building blocks: linear layers with weight loaders, norms, rotary, embeddings, attention."""

from pagoda.layers.attention import Attention
from pagoda.layers.embedding import LMHead, VocabEmbedding
from pagoda.layers.linear import GateUpLinear, Linear, PackedLinear, ShardId, default_weight_loader
from pagoda.layers.norm import RMSNorm
from pagoda.layers.rotary import RopeConfig, RotaryEmbedding, apply_rotary, rope_inverse_frequencies

__all__ = [
    "Attention",
    "GateUpLinear",
    "LMHead",
    "Linear",
    "PackedLinear",
    "RMSNorm",
    "RopeConfig",
    "RotaryEmbedding",
    "ShardId",
    "VocabEmbedding",
    "apply_rotary",
    "default_weight_loader",
    "rope_inverse_frequencies",
]
