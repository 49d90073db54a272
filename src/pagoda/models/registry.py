"""HF `architectures[0]` → model class and family flags.

Each family is a thin entry: the decoder is shared, the entry says which config keys turn on
biases, q/k norm and sliding windows, and the HF defaults for keys a config.json may omit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pagoda.models.base import CausalLM
from pagoda.models.decoder import DecoderForCausalLM


@dataclass(frozen=True)
class ModelFamily:
    architecture: str
    model_cls: type[CausalLM]
    # "config": q/k/v and o biases follow `attention_bias`; "qkv": q/k/v always biased, o never; "none".
    attention_bias: Literal["config", "qkv", "none"]
    mlp_bias_from_config: bool  # read `mlp_bias`
    qk_norm: bool
    # "none": never; "all": `sliding_window` on every layer; "qwen": `use_sliding_window` with
    # `layer_types` or `max_window_layers` choosing the windowed layers.
    sliding_window: Literal["none", "all", "qwen"]
    default_sliding_window: int | None
    default_head_dim: int | None  # when config.json has no head_dim; None: hidden_size // num_attention_heads
    default_max_position_embeddings: int


_FAMILIES: dict[str, ModelFamily] = {}


def register_model_family(family: ModelFamily) -> ModelFamily:
    if family.architecture in _FAMILIES:
        raise ValueError(f"architecture {family.architecture!r} is already registered")
    _FAMILIES[family.architecture] = family
    return family


def supported_architectures() -> list[str]:
    return sorted(_FAMILIES)


def get_model_family(architecture: str) -> ModelFamily:
    try:
        return _FAMILIES[architecture]
    except KeyError:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(supported_architectures())}"
        ) from None


register_model_family(
    ModelFamily(
        architecture="LlamaForCausalLM",
        model_cls=DecoderForCausalLM,
        attention_bias="config",
        mlp_bias_from_config=True,
        qk_norm=False,
        sliding_window="none",
        default_sliding_window=None,
        default_head_dim=None,
        default_max_position_embeddings=2048,
    )
)
register_model_family(
    ModelFamily(
        architecture="MistralForCausalLM",
        model_cls=DecoderForCausalLM,
        attention_bias="none",
        mlp_bias_from_config=False,
        qk_norm=False,
        sliding_window="all",
        default_sliding_window=4096,
        default_head_dim=None,
        default_max_position_embeddings=4096 * 32,
    )
)
register_model_family(
    ModelFamily(
        architecture="Qwen2ForCausalLM",
        model_cls=DecoderForCausalLM,
        attention_bias="qkv",
        mlp_bias_from_config=False,
        qk_norm=False,
        sliding_window="qwen",
        default_sliding_window=4096,
        default_head_dim=None,
        default_max_position_embeddings=32768,
    )
)
register_model_family(
    ModelFamily(
        architecture="Qwen3ForCausalLM",
        model_cls=DecoderForCausalLM,
        attention_bias="config",
        mlp_bias_from_config=False,
        qk_norm=True,
        sliding_window="qwen",
        default_sliding_window=4096,
        default_head_dim=128,
        default_max_position_embeddings=32768,
    )
)
