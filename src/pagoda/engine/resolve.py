"""EngineArgs plus what the model's config.json and the memory budget say → the frozen EngineConfig.

Every derived value (dtype, device, context length, KV block count, jump-forward limit) is worked
out here, once, before anything is loaded; the components only read their part of the result.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch

from pagoda.config import (
    CacheConfig,
    EngineArgs,
    EngineConfig,
    ModelConfig,
    SpeculativeConfig,
    StructuredOutputConfig,
)
from pagoda.distributed.sharding import kv_head_shard
from pagoda.models.config import ModelArchConfig
from pagoda.models.gguf import parse_gguf_config
from pagoda.models.hf_config import parse_hf_config, read_hf_config
from pagoda.quant.gguf_file import GGUFFile, default_dtype, is_gguf_path

logger = logging.getLogger(__name__)

# Measured on a 2-core CPU (random-weight model, 7-field JSON schema): jump-forward made one
# stream 3.9x faster, 8 streams 6% slower and 32 streams 22% slower than plain decoding.
CPU_JUMP_FORWARD_MAX_RUNNING = 4
# The speculative-decoding load gate on the CPU: proposals only while at most this many requests
# run. With one stream a draft verified in the same forward pass is nearly free (the weights are
# read once for all k + 1 rows), while a batch of decodes is compute-bound on a CPU and every
# rejected draft token costs a full token of work. Measured at Qwen2.5-0.5B's shape, n-gram K = 8,
# greedy, one thread, process CPU time, on/off (2-core AMD EPYC): 1 stream 1.97x, 4 streams 1.35x
# (acceptance 72%), 8 streams 0.87x (58%); 32 streams with the gate closed 0.99x.
CPU_SPECULATIVE_MAX_RUNNING = 4

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_engine_config(args: EngineArgs) -> EngineConfig:
    """Raises ValueError naming the problem (a model folder that does not parse, a context
    length beyond the model's)."""
    arch = _arch(args.model)
    parallel = args.parallel_config()
    arch.check_tensor_parallel(parallel.tensor_parallel_size)  # before any rank starts
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, args.model)
    # The memory budget is each rank's: a rank holds its own KV heads of every block.
    per_block = kv_bytes_per_block(arch, args.block_size, dtype, parallel.tensor_parallel_size)
    num_blocks = args.num_kv_blocks or max(1, int(args.kv_cache_memory_gb * 2**30) // per_block)
    max_model_len = args.max_model_len or arch.max_position_embeddings
    if max_model_len > arch.max_position_embeddings:
        raise ValueError(
            f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
            f"{arch.max_position_embeddings}"
        )
    capacity = num_blocks * args.block_size
    if max_model_len > capacity:
        logger.warning("max_model_len %d lowered to %d, what the KV pool holds", max_model_len, capacity)
        max_model_len = capacity
    jump_forward_limit = args.jump_forward_max_running or (
        CPU_JUMP_FORWARD_MAX_RUNNING if device.type == "cpu" else None
    )
    speculative = None
    if args.speculative_config is not None:
        speculative = SpeculativeConfig.from_dict(args.speculative_config)
        if speculative.max_running is None and device.type == "cpu":
            speculative = dataclasses.replace(speculative, max_running=CPU_SPECULATIVE_MAX_RUNNING)
    draft_model = draft_cache = None
    if speculative is not None and speculative.method == "draft_model":
        _check_draft(speculative.model, arch, args.model, dtype if args.dtype == "auto" else None)
        draft_model = ModelConfig(path=speculative.model, dtype=dtype, device=device, seed=args.seed)
        # The draft's pool holds as many tokens as the target's (the same blocks of the same
        # size, each of the draft's layer shapes): the draft keeps KV only for running requests.
        draft_cache = CacheConfig(args.block_size, num_blocks, enable_prefix_caching=True)
    if speculative is not None:
        prediction_max_running = speculative.max_running
    else:
        prediction_max_running = CPU_SPECULATIVE_MAX_RUNNING if device.type == "cpu" else None
    return EngineConfig(
        model=ModelConfig(
            path=args.model, dtype=dtype, device=device, seed=args.seed, quantization=args.quantization
        ),
        cache=CacheConfig(args.block_size, num_blocks, args.enable_prefix_caching),
        scheduler=args.scheduler_config(max_model_len),
        structured=StructuredOutputConfig(args.enable_jump_forward, jump_forward_limit),
        tokenizer=args.tokenizer or args.model,
        speculative=speculative,
        draft_model=draft_model,
        draft_cache=draft_cache,
        parallel=parallel,
        prediction_max_running=prediction_max_running,
        check_invariants=os.environ.get("PAGODA_CHECK_INVARIANTS", "") not in ("", "0"),
        step_log=args.step_log,
    )


def _arch(model: str) -> ModelArchConfig:
    if is_gguf_path(model):
        return parse_gguf_config(GGUFFile(model))[1]
    return parse_hf_config(read_hf_config(model))[1]


def _check_draft(draft: str, target: ModelArchConfig, target_path: str, dtype: torch.dtype | None) -> None:
    """A draft model must share the target's vocabulary (the tokenizers are compared when they
    load) and, where the engine takes the checkpoint's dtype, its dtype: it runs in the target's
    dtype on the target's device."""
    try:
        arch = _arch(draft)
    except (OSError, ValueError) as exc:
        raise ValueError(f"speculative_config: the draft model {draft!r} does not load: {exc}") from None
    if arch.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative_config: the draft model's vocabulary size ({arch.vocab_size}) differs from "
            f"the target's ({target.vocab_size}); a draft must share the target's tokenizer"
        )
    if dtype is not None:
        draft_dtype = resolve_dtype("auto", draft)
        if draft_dtype != dtype:
            raise ValueError(
                f"speculative_config: the draft model's dtype ({str(draft_dtype).removeprefix('torch.')}) "
                f"differs from the target's ({str(dtype).removeprefix('torch.')}); give both checkpoints "
                "the same dtype, or set dtype for both"
            )


def kv_bytes_per_block(
    arch: ModelArchConfig, block_size: int, dtype: torch.dtype, tensor_parallel_size: int = 1
) -> int:
    """Keys and values of `block_size` tokens in every layer, of one rank's KV heads (an equal
    share, or one head where there are fewer KV heads than ranks)."""
    heads = kv_head_shard(arch.num_kv_heads, 0, tensor_parallel_size)[1]
    return 2 * arch.num_layers * block_size * heads * arch.head_dim * dtype.itemsize


def resolve_dtype(dtype: str, model: str) -> torch.dtype:
    """'auto' takes the checkpoint's dtype: config.json's (float32 if it names none), or what a
    GGUF file's weights are best computed in."""
    if dtype == "auto":
        if is_gguf_path(model):
            return default_dtype(model)
        hf = read_hf_config(model)
        return _DTYPES.get(hf.get("torch_dtype") or hf.get("dtype") or "float32", torch.float32)
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
