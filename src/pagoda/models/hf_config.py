"""Parse a HF `config.json` (transformers 4 or 5 style) into a `ModelArchConfig`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pagoda.json_input import read_json_object
from pagoda.layers.rotary import RopeConfig
from pagoda.models.config import ModelArchConfig
from pagoda.models.registry import ModelFamily, get_model_family

_DEFAULT_ROPE_THETA = 10000.0
_LAYER_TYPES = ("full_attention", "sliding_attention")


def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir)
    if not path.is_dir():
        raise ValueError(f"model directory {str(path)!r} does not exist or is not a directory")
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ValueError(f"no config.json in model directory {str(path)!r}")
    return read_json_object(config_path)


def architecture_of(hf: dict[str, Any]) -> str:
    archs = hf.get("architectures")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise ValueError("config.json has no 'architectures' list naming the model class")
    return archs[0]


def parse_hf_config(hf: dict[str, Any]) -> tuple[ModelFamily, ModelArchConfig]:
    family = get_model_family(architecture_of(hf))
    if hf.get("quantization_config") is not None:
        raise ValueError("quantized checkpoints (config.json 'quantization_config') are not supported")
    hidden_act = hf.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ValueError(f"unsupported hidden_act {hidden_act!r}; only 'silu' is supported")

    hidden_size = _required(hf, "hidden_size")
    num_heads = _required(hf, "num_attention_heads")
    num_layers = _required(hf, "num_hidden_layers")
    num_kv_heads = hf.get("num_key_value_heads") or num_heads
    head_dim = hf.get("head_dim") or family.default_head_dim or _divide(hidden_size, num_heads)
    max_position = hf.get("max_position_embeddings") or family.default_max_position_embeddings

    attention_bias = bool(hf.get("attention_bias", False))
    qkv_bias = {"config": attention_bias, "qkv": True, "none": False}[family.attention_bias]
    o_proj_bias = family.attention_bias == "config" and attention_bias

    config = ModelArchConfig(
        architecture=family.architecture,
        hidden_size=hidden_size,
        intermediate_size=_required(hf, "intermediate_size"),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        vocab_size=_required(hf, "vocab_size"),
        max_position_embeddings=max_position,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        rope=parse_rope(hf, max_position),
        layer_sliding_windows=_sliding_windows(hf, family, num_layers, max_position),
        qkv_bias=qkv_bias,
        o_proj_bias=o_proj_bias,
        mlp_bias=family.mlp_bias_from_config and bool(hf.get("mlp_bias", False)),
        qk_norm=family.qk_norm,
    )
    return family, config


def parse_rope(hf: dict[str, Any], max_position: int) -> RopeConfig:
    """Read `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (older)."""
    params = hf.get("rope_parameters")
    if params is None:
        params = hf.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError(f"rope parameters must be a JSON object, got {params!r}")
    if params and all(key in _LAYER_TYPES for key in params):
        raise ValueError("per-layer-type rope parameters are not supported")
    theta = params.get("rope_theta", hf.get("rope_theta", _DEFAULT_ROPE_THETA))
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"partial rotary embeddings are not supported (partial_rotary_factor={partial})")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "llama3":
        return RopeConfig(
            theta=float(theta),
            rope_type="llama3",
            factor=params.get("factor"),
            low_freq_factor=params.get("low_freq_factor"),
            high_freq_factor=params.get("high_freq_factor"),
            original_max_position_embeddings=params.get("original_max_position_embeddings", max_position),
        )
    return RopeConfig(theta=float(theta), rope_type=rope_type)


def _sliding_windows(
    hf: dict[str, Any], family: ModelFamily, num_layers: int, max_position: int
) -> tuple[int | None, ...]:
    if family.sliding_window == "none":
        return (None,) * num_layers
    window = hf.get("sliding_window", family.default_sliding_window)
    if family.sliding_window == "all":
        windowed = [True] * num_layers
    else:
        if not hf.get("use_sliding_window", False):
            window = None
        layer_types = hf.get("layer_types")
        if layer_types is not None:
            if len(layer_types) != num_layers or any(t not in _LAYER_TYPES for t in layer_types):
                raise ValueError(
                    f"layer_types must list {num_layers} entries from {_LAYER_TYPES}, got {layer_types!r}"
                )
            windowed = [t == "sliding_attention" for t in layer_types]
        else:
            first = hf.get("max_window_layers", 28)
            windowed = [index >= first for index in range(num_layers)]
    if window is None:
        return (None,) * num_layers
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        raise ValueError(f"sliding_window must be a positive integer, got {window!r}")
    # A window no shorter than the position range never hides anything.
    if window >= max_position:
        return (None,) * num_layers
    return tuple(window if w else None for w in windowed)


def _required(hf: dict[str, Any], key: str) -> int:
    if key not in hf:
        raise ValueError(f"config.json is missing {key!r}")
    value = hf[key]
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"config.json {key!r} must be a positive integer, got {value!r}")
    return value


def _divide(hidden_size: int, num_heads: int) -> int:
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size ({hidden_size}) is not divisible by num_attention_heads ({num_heads})")
    return hidden_size // num_heads
