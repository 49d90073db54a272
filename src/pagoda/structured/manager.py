"""GrammarManager: the engine's one entry point to structured output.

Compiles specs off the engine loop (thread pool → Future) with a cache keyed by the canonical spec, hands
out matchers, fills the batch bitmask and plans jump-forward tokens.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch
import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

from pagoda.sampling_params import StructuredOutputs
from pagoda.structured.compile_pool import CompilePool, GrammarBusyError
from pagoda.structured.interface import CompiledGrammar, GrammarBackend, GrammarMatcher
from pagoda.structured.jump_forward import JumpForward
from pagoda.structured.spec import SpecKey, spec_key
from pagoda.structured.xgrammar_backend import XGrammarBackend


@dataclass(frozen=True)
class GrammarConfig:
    """Structured-output settings. ``compile_workers`` threads compile grammars off the engine loop; the
    ``cache_size`` most recently used compiled grammars are kept; ``fill_threads`` > 1 fills the batch
    bitmask in parallel; ``any_whitespace=False`` forbids free whitespace in JSON output. A compile
    taking longer than ``compile_timeout_s`` fails (see ``compile_pool``)."""

    backend: str = "xgrammar"
    any_whitespace: bool = True
    compile_workers: int = 1
    cache_size: int = 256
    fill_threads: int = 1
    compile_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.backend not in _BACKENDS:
            raise ValueError(f"unknown grammar backend {self.backend!r}; available: {sorted(_BACKENDS)}")
        for name in ("compile_workers", "cache_size", "fill_threads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GrammarConfig.{name} must be an integer >= 1, got {value!r}")
        if not (isinstance(self.compile_timeout_s, int | float) and self.compile_timeout_s > 0):
            raise ValueError(f"GrammarConfig.compile_timeout_s must be > 0, got {self.compile_timeout_s!r}")


def _xgrammar(
    tokenizer: PreTrainedTokenizerBase,
    vocab_size: int | None,
    eos_token_ids: Sequence[int] | None,
    config: GrammarConfig,
) -> GrammarBackend:
    return XGrammarBackend(
        tokenizer,
        vocab_size=vocab_size,
        eos_token_ids=eos_token_ids,
        any_whitespace=config.any_whitespace,
        compile_threads=config.compile_workers,
        fill_threads=config.fill_threads,
    )


_BACKENDS: dict[
    str, Callable[[PreTrainedTokenizerBase, int | None, Sequence[int] | None, GrammarConfig], GrammarBackend]
] = {"xgrammar": _xgrammar}


class GrammarManager:
    """Compile cache + async compilation + batch bitmask + jump-forward for one engine (one tokenizer)."""

    def __init__(
        self,
        backend: GrammarBackend,
        *,
        encode: Callable[[str], Sequence[int]] | None = None,
        compile_workers: int = 1,
        cache_size: int = 256,
        compile_timeout_s: float = 30.0,
    ) -> None:
        if compile_workers < 1 or cache_size < 1:
            raise ValueError(
                f"compile_workers and cache_size must be >= 1, got {compile_workers}, {cache_size}"
            )
        self._backend = backend
        self._cache: OrderedDict[SpecKey, Future[CompiledGrammar]] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        # At most compile_workers grammars past their deadline may burn CPU at a time.
        self._pool = CompilePool(compile_workers, compile_timeout_s, max_abandoned=compile_workers)
        self._jump_forward = (
            JumpForward(encode, backend.token_bytes, backend.vocab_size) if encode is not None else None
        )

    @classmethod
    def from_tokenizer(
        cls,
        tokenizer: PreTrainedTokenizerBase,
        *,
        vocab_size: int | None = None,
        eos_token_ids: Sequence[int] | None = None,
        config: GrammarConfig | None = None,
    ) -> GrammarManager:
        """``vocab_size``: the model's (lm_head rows); ``eos_token_ids``: the model's EOS ids (default:
        the tokenizer's)."""
        config = config or GrammarConfig()
        backend = _BACKENDS[config.backend](tokenizer, vocab_size, eos_token_ids, config)
        return cls(
            backend,
            encode=lambda text: tokenizer.encode(text, add_special_tokens=False),
            compile_workers=config.compile_workers,
            cache_size=config.cache_size,
            compile_timeout_s=config.compile_timeout_s,
        )

    @property
    def backend(self) -> GrammarBackend:
        return self._backend

    @property
    def vocab_size(self) -> int:
        return self._backend.vocab_size

    # ---- compilation -------------------------------------------------------------------------------

    def compile_async(self, spec: StructuredOutputs) -> Future[CompiledGrammar]:
        """A Future of the compiled grammar; never blocks on compilation.

        A malformed spec (schema not JSON, not a valid JSON Schema) raises ValueError here; a spec the
        backend cannot compile (bad regex, bad grammar, unsupported schema) makes the Future raise
        ValueError (``GrammarTimeoutError`` past the compile timeout; ``GrammarBusyError``, not cached,
        while too many timed-out compiles still run). The same spec (dict schemas up to key order)
        returns the same Future while cached.
        """
        key = spec_key(spec)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._backend.compile, spec)
            if future.done() and isinstance(future.exception(), GrammarBusyError):
                return future  # refused for now, not a property of the spec: not cached
            self._cache[key] = future
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return future

    def compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        """Blocking compile through the same cache (for tests and offline use; not the engine loop)."""
        return self.compile_async(spec).result()

    def cached_specs(self) -> int:
        with self._lock:
            return len(self._cache)

    def new_matcher(self, compiled: CompiledGrammar) -> GrammarMatcher:
        return compiled.new_matcher()

    # ---- per-step masking --------------------------------------------------------------------------

    def allocate_bitmask(self, batch_size: int) -> torch.Tensor:
        """An all-allowed int32 CPU bitmask [batch_size, ceil(vocab_size / 32)]."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        return xgr.allocate_token_bitmask(batch_size, self.vocab_size)

    def fill_bitmask(self, bitmask: torch.Tensor, matchers: Sequence[GrammarMatcher | None]) -> bool:
        """Fill row i from ``matchers[i]``; rows whose matcher is None are reset to all-allowed.

        Returns whether any row is constrained (if not, the sampler can skip masking).
        """
        if bitmask.dim() != 2 or bitmask.shape[0] < len(matchers):
            raise ValueError(
                f"bitmask of shape {tuple(bitmask.shape)} has fewer rows than {len(matchers)} matchers"
            )
        rows = [i for i, m in enumerate(matchers) if m is not None]
        free_rows = [i for i, m in enumerate(matchers) if m is None]
        if free_rows:
            bitmask[free_rows] = -1
        if rows:
            self._backend.fill_bitmasks([matchers[i] for i in rows], bitmask, rows)  # type: ignore[misc]
        return bool(rows)

    # ---- jump-forward ------------------------------------------------------------------------------

    def jump_forward(
        self, matcher: GrammarMatcher, output_token_ids: Sequence[int], max_tokens: int | None = None
    ) -> list[int]:
        """Tokens the grammar forces next, already accepted into ``matcher`` (see ``JumpForward``)."""
        if self._jump_forward is None:
            raise ValueError("jump-forward needs the tokenizer: build the manager with encode=...")
        return self._jump_forward(matcher, output_token_ids, max_tokens)

    def wait_for_compiles(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for compiles still running (xgrammar cannot interrupt them, and
        a process must not exit in the middle of one); True if none is left."""
        return self._pool.wait(timeout_s)

    def shutdown(self) -> None:
        self._pool.shutdown()
