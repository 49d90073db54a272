"""Engine configuration, declared once.

`EngineArgs` is what a user may set: the keyword arguments of `LLM(...)` and, generated from its
fields (`pagoda.cli_args`), the engine flags of `pagoda serve / generate / chat / bench offline`.
`pagoda.engine.resolve.resolve_engine_config` turns it, with what the model's config.json and the
KV memory budget say, into one frozen `EngineConfig`; each component gets its part of that:
the model runner `ModelConfig`, the KV cache `CacheConfig`, the scheduler `SchedulerConfig`, the
engine core's structured-output settings `StructuredOutputConfig`.

Stdlib only at import time (torch only in annotations), so that building the CLI stays fast.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from pagoda.cli_args import arg
from pagoda.limits import RequestLimits

if TYPE_CHECKING:
    import torch

# Weight types a float checkpoint can be quantized to at load (pagoda.quant.formats.LOAD_TIME_TYPES).
LOAD_TIME_QUANTIZATIONS = ("q8_0", "q4_0", "q4_k")
DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16", "half")


@dataclass(frozen=True)
class EngineArgs:
    """Everything a user may set when creating an engine (flat, vLLM-style names).

    To add an engine option: add a field here with `arg(default, help=...)`, validate it in
    `__post_init__`, and resolve it in `pagoda.engine.resolve` into the part of `EngineConfig`
    whose component uses it. The flag `--field-name` appears on every engine command.
    """

    model: str  # a Hugging Face model folder or a .gguf file; the commands' positional MODEL
    tokenizer: str | None = arg(
        None, help="tokenizer folder", default_text="MODEL (a GGUF file's own tokenizer)"
    )
    quantization: str | None = arg(
        None,
        help="quantize a float checkpoint's weights at load",
        choices=LOAD_TIME_QUANTIZATIONS,
        default_text="as stored",
    )
    dtype: str = arg(
        "auto",
        help="weight and activation dtype; auto: the checkpoint's (float32 if it names none)",
        choices=DTYPE_NAMES,
    )
    device: str = arg("auto", help="auto, cpu, cuda or cuda:N; auto: cuda if available, else cpu")
    seed: int = arg(0, help="engine random seed")
    block_size: int = arg(16, help="tokens per KV block")
    num_kv_blocks: int | None = arg(
        None, help="KV blocks to allocate (wins over --kv-cache-memory-gb)", default_text="from the memory"
    )
    kv_cache_memory_gb: float = arg(1.0, help="memory for the KV cache, GiB")
    enable_prefix_caching: bool = arg(True, help="reuse the KV of shared prompt prefixes")
    max_model_len: int | None = arg(None, help="context length", default_text="the model's maximum")
    max_num_seqs: int = arg(256, help="sequences per step")
    max_num_batched_tokens: int = arg(2048, help="tokens per step")
    scheduling_policy: Literal["fcfs", "lpm"] = arg(
        "lpm", help="order of waiting requests: first come first served, or longest prefix match"
    )
    enable_jump_forward: bool = arg(True, help="structured output: emit forced tokens without a forward pass")
    # Measured on a 2-core CPU: drafts pay off for a few streams, not for a large decode batch,
    # which is compute-bound there (see pagoda.engine.resolve.CPU_JUMP_FORWARD_MAX_RUNNING).
    jump_forward_max_running: int | None = arg(
        None,
        help="propose jump-forward drafts only while at most this many requests run",
        default_text="4 on the CPU, no limit elsewhere",
    )
    speculative_config: dict[str, Any] | None = arg(
        None,
        help='speculative decoding, as vLLM spells it: a JSON object such as {"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4} or {"method": '
        '"draft_model", "model": PATH, "num_speculative_tokens": 4}',
        metavar="JSON",
    )
    tensor_parallel_size: int = arg(
        1, help="ranks to split every layer over (Megatron-style; one process per rank)"
    )
    threads_per_rank: int | None = arg(
        None,
        help="torch threads of each rank, each rank pinned to its own cores",
        default_text="the available cores divided among this node's ranks",
    )
    nnodes: int = arg(1, help="machines the tensor-parallel ranks are spread over (equal shares)")
    node_rank: int = arg(0, help="this machine's index among --nnodes; node 0 schedules and serves")
    master_addr: str = arg("127.0.0.1", help="address of node 0, where the ranks meet")
    master_port: int | None = arg(
        None,
        help="port on node 0 where the ranks meet",
        default_text="a free port (one node); 29500 (several)",
    )
    headless: bool = arg(
        False, help="a node other than 0: run only this node's worker ranks (no scheduler, no server)"
    )
    distributed_timeout: float = arg(
        60.0, help="seconds a rank waits for the others to join, or for one collective, before failing"
    )
    step_log: str | None = arg(
        None,
        help="append one JSON line per engine step to FILE (its time, duration, requests and tokens)",
        metavar="FILE",
        default_text="off",
    )
    # Limits on every size a request can choose (n, stop strings, grammar size, ...): see limits.py.
    # Its fields are flags of `pagoda serve` themselves (--max-n, ...).
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
        if self.quantization is not None and self.quantization not in LOAD_TIME_QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {', '.join(LOAD_TIME_QUANTIZATIONS)}, got {self.quantization!r}"
            )
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose one of auto, float32, bfloat16, float16")
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not isinstance(self.block_size, int) or not 1 <= self.block_size <= 1024:
            raise ValueError(f"block_size must be an integer in [1, 1024], got {self.block_size!r}")
        if self.num_kv_blocks is not None and (
            not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks < 1
        ):
            raise ValueError(f"num_kv_blocks must be a positive integer, got {self.num_kv_blocks!r}")
        if not self.kv_cache_memory_gb > 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        if self.max_model_len is not None and (
            not isinstance(self.max_model_len, int) or self.max_model_len < 2
        ):
            raise ValueError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        if self.jump_forward_max_running is not None and (
            not isinstance(self.jump_forward_max_running, int) or self.jump_forward_max_running < 1
        ):
            raise ValueError(
                f"jump_forward_max_running must be an integer >= 1, got {self.jump_forward_max_running!r}"
            )
        if self.speculative_config is not None:
            SpeculativeConfig.from_dict(self.speculative_config)
        self.parallel_config()  # the tensor-parallel settings' own checks
        if self.step_log is not None and (not isinstance(self.step_log, str) or not self.step_log):
            raise ValueError(f"step_log must be a file path, got {self.step_log!r}")
        if self.step_log is not None and not os.path.isdir(os.path.dirname(os.path.abspath(self.step_log))):
            raise ValueError(f"step_log {self.step_log!r}: its folder does not exist")
        if not isinstance(self.limits, RequestLimits):
            raise ValueError(f"limits must be a RequestLimits, got {type(self.limits).__name__}")
        # The scheduler's own checks, before the model loads (the context length is not known yet).
        self.scheduler_config(self.max_model_len or 2)

    def parallel_config(self) -> ParallelConfig:
        port = self.master_port
        if port is None:
            port = 0 if self.nnodes == 1 else DEFAULT_MASTER_PORT
        return ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            nnodes=self.nnodes,
            node_rank=self.node_rank,
            master_addr=self.master_addr,
            master_port=port,
            threads_per_rank=self.threads_per_rank,
            headless=self.headless,
            timeout_s=self.distributed_timeout,
        )

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=max_model_len,
            policy=self.scheduling_policy,
        )


# ---- the resolved configuration: one frozen part per component ----------------------------------------
DEFAULT_MASTER_PORT = 29500


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism: `tensor_parallel_size` ranks over `nnodes` machines, the same number on
    each. Global rank = node_rank x ranks per node + local rank; global rank 0 (on node 0) is the
    engine process: it schedules, samples and serves, and every step broadcasts the batch to the
    others. `master_port` 0: pick a free port on this machine (one node only)."""

    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    threads_per_rank: int | None = None
    headless: bool = False
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "nnodes"):
            if not _positive_int(getattr(self, name)):
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(
                f"tensor_parallel_size ({self.tensor_parallel_size}) must be a multiple of nnodes "
                f"({self.nnodes}): every node runs the same number of ranks"
            )
        if not isinstance(self.node_rank, int) or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in 0..{self.nnodes - 1}, got {self.node_rank!r}")
        if self.threads_per_rank is not None and not _positive_int(self.threads_per_rank):
            raise ValueError(f"threads_per_rank must be a positive integer, got {self.threads_per_rank!r}")
        if not isinstance(self.master_addr, str) or not self.master_addr:
            raise ValueError("master_addr must be a host name or address")
        if not isinstance(self.master_port, int) or not 0 <= self.master_port <= 65535:
            raise ValueError(f"master_port must be a port number in 1..65535, got {self.master_port!r}")
        if self.nnodes > 1 and self.master_port == 0:
            raise ValueError("master_port must be given when the ranks span several nodes")
        if not isinstance(self.timeout_s, int | float) or not self.timeout_s > 0:
            raise ValueError(
                f"distributed_timeout must be a positive number of seconds, got {self.timeout_s!r}"
            )
        if self.tensor_parallel_size == 1 and self.master_port:
            raise ValueError("master_port is where tensor-parallel ranks meet; tensor_parallel_size is 1")
        if self.headless and self.node_rank == 0:
            raise ValueError("node 0 schedules and serves; only a node with node_rank > 0 runs --headless")
        if self.node_rank > 0 and not self.headless:
            raise ValueError(
                f"node_rank {self.node_rank} runs only worker ranks: start it with --headless "
                "(node 0 schedules and serves)"
            )

    @property
    def local_size(self) -> int:
        """Ranks on each node."""
        return self.tensor_parallel_size // self.nnodes

    def global_rank(self, local_rank: int) -> int:
        return self.node_rank * self.local_size + local_rank


@dataclass(frozen=True)
class ModelConfig:
    """What the model runner loads and runs."""

    path: str  # a model folder or a .gguf file
    dtype: torch.dtype
    device: torch.device
    seed: int  # of the sampler's shared generator
    quantization: str | None = None  # quantize at load (a float checkpoint only)


@dataclass(frozen=True)
class CacheConfig:
    """The KV cache: its block geometry, size and whether prefixes are shared."""

    block_size: int
    num_blocks: int
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {self.num_blocks}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096  # the context length: prompt plus generated tokens
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


SPECULATIVE_METHODS = ("ngram", "draft_model")
# The keys each method takes (anything else in a speculative_config is an error).
_SPECULATIVE_KEYS = {
    "ngram": ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "max_running"),
    "draft_model": ("method", "model", "num_speculative_tokens", "max_running"),
}


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (`EngineArgs.speculative_config`, vLLM's keys). Drafts from a proposer
    are verified by the target model in one forward pass and one sampler call.

    ngram (prompt lookup decoding): the longest suffix of the sequence, between prompt_lookup_min
    and prompt_lookup_max tokens, that occurred earlier proposes the tokens that followed it.
    draft_model: a small model (`model`: a folder or GGUF file) sharing the target's tokenizer
    proposes num_speculative_tokens tokens a step (spec/draft_model.py).
    `max_running`: proposals only while at most this many requests run (the load gate; None: the
    device's default, see pagoda.engine.resolve)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 2  # given only one of the two, the other follows it
    prompt_lookup_max: int = 4
    max_running: int | None = None
    model: str | None = None  # the draft model (method draft_model only)

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config: unknown method {self.method!r}; choose one of "
                f"{', '.join(SPECULATIVE_METHODS)}"
            )
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config: {name} must be a positive integer, got {value!r}")
        if self.num_speculative_tokens > 64:
            raise ValueError(
                f"speculative_config: num_speculative_tokens must be at most 64, got {self.num_speculative_tokens}"
            )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config: prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )
        if self.max_running is not None and (
            not isinstance(self.max_running, int)
            or isinstance(self.max_running, bool)
            or self.max_running < 1
        ):
            raise ValueError(
                f"speculative_config: max_running must be a positive integer, got {self.max_running!r}"
            )
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError(
                "speculative_config: method 'draft_model' needs 'model' (the draft model's folder or "
                "GGUF file); other methods take none"
            )
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise ValueError(f"speculative_config: model must be a path, got {self.model!r}")

    @property
    def max_running_or_unlimited(self) -> float:
        return float("inf") if self.max_running is None else self.max_running

    @classmethod
    def from_dict(cls, config: Any) -> SpeculativeConfig:
        """Validate a user's speculative_config (a dict, as from JSON); unknown keys are errors."""
        if isinstance(config, SpeculativeConfig):
            return config
        if not isinstance(config, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(config).__name__}")
        method = config.get("method")
        if method is None:
            raise ValueError(f"speculative_config needs a 'method' (one of {', '.join(SPECULATIVE_METHODS)})")
        if method not in _SPECULATIVE_KEYS:
            raise ValueError(
                f"speculative_config: unknown method {method!r}; choose one of {', '.join(SPECULATIVE_METHODS)}"
            )
        allowed = _SPECULATIVE_KEYS[method]
        unknown = sorted(set(config) - set(allowed))
        if unknown:
            raise ValueError(
                f"speculative_config: unknown key(s) {', '.join(map(repr, unknown))} for method {method!r}; "
                f"allowed: {', '.join(allowed)}"
            )
        if "num_speculative_tokens" not in config:
            raise ValueError("speculative_config needs 'num_speculative_tokens'")
        config = dict(config)
        lo, hi = config.get("prompt_lookup_min"), config.get("prompt_lookup_max")
        if isinstance(lo, int) and hi is None:
            config["prompt_lookup_max"] = max(lo, cls.prompt_lookup_max)
        elif isinstance(hi, int) and lo is None:
            config["prompt_lookup_min"] = min(hi, cls.prompt_lookup_min)
        return cls(**config)


@dataclass(frozen=True)
class StructuredOutputConfig:
    enable_jump_forward: bool = True
    jump_forward_max_running: int | None = None  # None: no limit


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine runs with, resolved once (see `pagoda.engine.resolve`)."""

    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    structured: StructuredOutputConfig
    tokenizer: str  # tokenizer folder
    speculative: SpeculativeConfig | None = None  # with max_running resolved
    # The draft model (speculative method draft_model): loaded in the target's dtype on its
    # device, on rank 0 only and unsharded, with a KV pool of its own (draft_cache).
    draft_model: ModelConfig | None = None
    draft_cache: CacheConfig | None = None
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    # The load gate of predicted outputs (SamplingParams.prediction): drafts from a prediction only
    # while at most this many requests run (None: no limit); speculative.max_running when set.
    prediction_max_running: int | None = None
    # Check the KV block accounting after every step, not only when the engine goes idle (a debug
    # switch: PAGODA_CHECK_INVARIANTS=1; the test suite turns it on).
    check_invariants: bool = False
    step_log: str | None = None  # EngineArgs.step_log: the engine core appends a line per step

    @property
    def max_model_len(self) -> int:
        return self.scheduler.max_model_len
