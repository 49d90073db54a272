"""EngineArgs + the model's config.json + the memory budget → one frozen EngineConfig, before anything loads."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from pagoda.config import EngineArgs
from pagoda.engine.resolve import CPU_JUMP_FORWARD_MAX_RUNNING, resolve_engine_config

# The tiny checkpoints (tests/conftest.py): 2 layers, 2 KV heads of 16 dims, 512 positions, float32.
KV_BYTES_PER_TOKEN_FP32 = 2 * 2 * 2 * 16 * 4


def test_defaults_come_from_the_model_and_the_memory(tiny_llama_dir: str) -> None:
    config = resolve_engine_config(EngineArgs(model=tiny_llama_dir, device="cpu"))
    assert config.model.dtype == torch.float32  # "auto": the checkpoint's
    assert config.model.device == torch.device("cpu") and config.model.path == tiny_llama_dir
    assert config.tokenizer == tiny_llama_dir
    assert config.max_model_len == 512 == config.scheduler.max_model_len  # max_position_embeddings
    assert config.cache.num_blocks == 2**30 // (16 * KV_BYTES_PER_TOKEN_FP32)  # 1 GiB of 16-token blocks
    assert config.structured.jump_forward_max_running == CPU_JUMP_FORWARD_MAX_RUNNING
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.cache.num_blocks = 1  # type: ignore[misc]


def test_explicit_values_win(tiny_llama_dir: str) -> None:
    args = EngineArgs(
        model=tiny_llama_dir,
        tokenizer=tiny_llama_dir,
        dtype="bf16",
        block_size=8,
        num_kv_blocks=40,
        max_model_len=300,
        jump_forward_max_running=9,
        enable_jump_forward=False,
        enable_prefix_caching=False,
        scheduling_policy="fcfs",
    )
    config = resolve_engine_config(args)
    assert config.model.dtype == torch.bfloat16
    assert (config.cache.block_size, config.cache.num_blocks, config.cache.enable_prefix_caching) == (
        8,
        40,
        False,
    )
    assert (config.max_model_len, config.scheduler.policy) == (300, "fcfs")
    assert (config.structured.enable_jump_forward, config.structured.jump_forward_max_running) == (False, 9)
    # The memory budget sizes the pool by the resolved dtype: bf16 blocks are half as big.
    half = resolve_engine_config(dataclasses.replace(args, num_kv_blocks=None, kv_cache_memory_gb=0.5))
    assert half.cache.num_blocks == 2**29 // (8 * KV_BYTES_PER_TOKEN_FP32 // 2)


def test_the_context_is_bounded_by_the_model_and_the_pool(tiny_llama_dir: str) -> None:
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings 512"):
        resolve_engine_config(EngineArgs(model=tiny_llama_dir, max_model_len=513))
    small = resolve_engine_config(EngineArgs(model=tiny_llama_dir, num_kv_blocks=4, block_size=16))
    assert small.max_model_len == 64  # lowered to what 4 blocks hold


def test_auto_dtype_reads_the_checkpoint(tiny_llama_dir: str, tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    hf = json.loads((model / "config.json").read_text())
    hf.pop("dtype", None)
    hf["torch_dtype"] = "bfloat16"
    (model / "config.json").write_text(json.dumps(hf))
    assert resolve_engine_config(EngineArgs(model=str(model))).model.dtype == torch.bfloat16


def test_bad_values_fail_before_anything_loads(tiny_llama_dir: str, tmp_path: Path) -> None:
    for kwargs, message in [
        ({"dtype": "float64"}, "unknown dtype"),
        ({"block_size": 0}, "block_size"),
        ({"num_kv_blocks": 0}, "num_kv_blocks"),
        ({"kv_cache_memory_gb": 0}, "kv_cache_memory_gb"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"scheduling_policy": "random"}, "scheduling policy"),
    ]:
        with pytest.raises(ValueError, match=message):
            EngineArgs(model=tiny_llama_dir, **kwargs)
    with pytest.raises(ValueError, match="unknown device"):
        resolve_engine_config(EngineArgs(model=tiny_llama_dir, device="gpu9"))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"architectures": ["NoSuchForCausalLM"]}))
    with pytest.raises(ValueError, match="NoSuchForCausalLM"):
        resolve_engine_config(EngineArgs(model=str(broken)))
