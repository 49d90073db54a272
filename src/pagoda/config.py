"""Frozen, validated configuration of each engine component."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Literal

import torch

from pagoda.limits import RequestLimits

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype, model_dir: str) -> torch.dtype:
    """'auto' takes the checkpoint's dtype (float32 if it names none)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; use float32, bfloat16 or float16")
        return dtype
    if dtype == "auto":
        if model_dir.lower().endswith(".gguf"):
            from pagoda.quant.gguf_file import default_dtype

            return default_dtype(model_dir)
        with open(os.path.join(model_dir, "config.json")) as f:
            cfg = json.load(f)
        name = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
        return _DTYPES.get(name, torch.float32)
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of auto, float32, bfloat16, float16")
    return _DTYPES[dtype]


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"unknown device {device!r}: {e}") from None


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_kv_blocks: int | None = None  # wins over kv_cache_memory_gb when given
    kv_cache_memory_gb: float = 1.0
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size < 1 or self.block_size > 1024:
            raise ValueError(f"block_size must be an integer in [1, 1024], got {self.block_size!r}")
        if self.num_kv_blocks is not None and (
            not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks < 1
        ):
            raise ValueError(f"num_kv_blocks must be a positive integer, got {self.num_kv_blocks!r}")
        if not self.kv_cache_memory_gb > 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    policy: Literal["fcfs", "lpm"] = "lpm"
    # lpm (longest prefix match) may reorder the waiting queue; a request passed over this many
    # times is served next regardless, so nothing starves.
    max_skips: int = 8

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "max_skips"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < (0 if name == "max_skips" else 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.policy not in ("fcfs", "lpm"):
            raise ValueError(f"scheduling policy must be 'fcfs' or 'lpm', got {self.policy!r}")


@dataclass(frozen=True)
class EngineArgs:
    """Everything a user may set when creating an engine (flat, vLLM-style names)."""

    model: str  # a Hugging Face model folder or a .gguf file
    tokenizer: str | None = None  # defaults to the model folder (or the GGUF file's own tokenizer)
    # Quantize a float checkpoint's weights at load: "q8_0", "q4_0" or "q4_k" (None: as stored).
    quantization: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float = 1.0
    enable_prefix_caching: bool = True
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    scheduling_policy: str = "lpm"
    enable_jump_forward: bool = True
    # Propose jump-forward drafts only while at most this many requests run. None: 4 on the CPU
    # (a larger decode batch is compute-bound there, so rejected drafts cost more than the passes
    # they save), no limit on other devices.
    jump_forward_max_running: int | None = None
    # Limits on every size a request can choose (n, stop strings, grammar size, ...): see limits.py.
    limits: RequestLimits = field(default_factory=RequestLimits)

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("model must be the path of a Hugging Face model folder or a .gguf file")
        if self.model.lower().endswith(".gguf"):
            if not os.path.isfile(self.model):
                raise ValueError(f"GGUF file {self.model!r} does not exist")
            if self.quantization is not None:
                raise ValueError(
                    "quantization applies to safetensors checkpoints; a GGUF file keeps its own types"
                )
        elif not os.path.isdir(self.model):
            raise ValueError(f"model folder {self.model!r} does not exist")
        elif not os.path.isfile(os.path.join(self.model, "config.json")):
            raise ValueError(f"model folder {self.model!r} has no config.json")
        if self.quantization is not None:
            from pagoda.quant.formats import LOAD_TIME_TYPES

            if self.quantization not in LOAD_TIME_TYPES:
                raise ValueError(
                    f"quantization must be one of {', '.join(LOAD_TIME_TYPES)}, got {self.quantization!r}"
                )
        if self.max_model_len is not None and (
            not isinstance(self.max_model_len, int) or self.max_model_len < 2
        ):
            raise ValueError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.jump_forward_max_running is not None and (
            not isinstance(self.jump_forward_max_running, int) or self.jump_forward_max_running < 1
        ):
            raise ValueError(
                f"jump_forward_max_running must be an integer >= 1, got {self.jump_forward_max_running!r}"
            )
        if not isinstance(self.limits, RequestLimits):
            raise ValueError(f"limits must be a RequestLimits, got {type(self.limits).__name__}")
        # Validate the component configs early, so a bad value fails before the model loads.
        self.cache_config()
        self.scheduler_config(self.max_model_len or 2)

    def cache_config(self) -> CacheConfig:
        return CacheConfig(
            block_size=self.block_size,
            num_kv_blocks=self.num_kv_blocks,
            kv_cache_memory_gb=self.kv_cache_memory_gb,
            enable_prefix_caching=self.enable_prefix_caching,
        )

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=max_model_len,
            policy=self.scheduling_policy,  # type: ignore[arg-type]
        )
