"""The architecture description the model code is built from (parsed from a HF config.json)."""

from __future__ import annotations

from dataclasses import dataclass

from pagoda.layers.rotary import RopeConfig


@dataclass(frozen=True)
class ModelArchConfig:
    architecture: str  # HF `architectures[0]`
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    rope: RopeConfig
    # One entry per layer: the layer's sliding window, or None for full attention.
    layer_sliding_windows: tuple[int | None, ...]
    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False

    def __post_init__(self) -> None:
        for name in (
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "vocab_size",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be positive, got {self.rms_norm_eps}")
        if len(self.layer_sliding_windows) != self.num_layers:
            raise ValueError(
                f"layer_sliding_windows has {len(self.layer_sliding_windows)} entries for {self.num_layers} layers"
            )
        bad = [w for w in self.layer_sliding_windows if w is not None and (not isinstance(w, int) or w <= 0)]
        if bad:
            raise ValueError(f"sliding windows must be positive integers or None, got {bad[0]!r}")

    def check_tensor_parallel(self, size: int) -> None:
        """ValueError unless this shape splits over `size` ranks: attention heads and the MLP's
        intermediate size evenly, KV heads evenly or (fewer KV heads than ranks) replicated."""
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {size!r}")
        problems = []
        if self.num_heads % size:
            problems.append(f"num_attention_heads ({self.num_heads})")
        if self.num_kv_heads % size and size % self.num_kv_heads:
            problems.append(f"num_key_value_heads ({self.num_kv_heads}; or the size a multiple of it)")
        if self.intermediate_size % size:
            problems.append(f"intermediate_size ({self.intermediate_size})")
        if self.vocab_size < size:
            problems.append(f"vocab_size ({self.vocab_size}; at least the size)")
        if problems:
            raise ValueError(
                f"{self.architecture} cannot be split over tensor_parallel_size={size}: "
                f"{', '.join(problems)} must be divisible by it"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim
