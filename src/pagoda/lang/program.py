"""`@pl.function`: a program, with `run`, `run_batch` and `bind` (SGLang's names and defaults)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

from pagoda.lang.backend.base import Backend
from pagoda.lang.interpreter import ProgramState, run_program, run_program_batch
from pagoda.lang.ir import GenParams

MAX_BATCH_THREADS = 128  # num_threads="auto": at most this many programs at once

_default_backend: Backend | None = None


def set_default_backend(backend: Backend) -> None:
    global _default_backend
    if not isinstance(backend, Backend):
        raise TypeError(f"a backend is a pl.Engine or a pl.RuntimeEndpoint, got {type(backend).__name__}")
    _default_backend = backend


def get_default_backend() -> Backend | None:
    return _default_backend


def _resolve_backend(backend: Backend | None) -> Backend:
    backend = backend if backend is not None else _default_backend
    if backend is None:
        raise ValueError(
            "no backend: call pl.set_default_backend(pl.Engine(model=...)) or "
            "pl.set_default_backend(pl.RuntimeEndpoint(url)), or pass backend=..."
        )
    if not isinstance(backend, Backend):
        raise TypeError(f"a backend is a pl.Engine or a pl.RuntimeEndpoint, got {type(backend).__name__}")
    return backend


def _defaults(
    max_new_tokens: int,
    stop: str | Sequence[str],
    stop_token_ids: Sequence[int],
    temperature: float,
    top_p: float,
    top_k: int,
    min_p: float,
    frequency_penalty: float,
    presence_penalty: float,
    ignore_eos: bool,
    return_logprob: bool | None,
    top_logprobs_num: int | None,
) -> GenParams:
    defaults = GenParams(
        max_tokens=max_new_tokens,
        stop=stop,  # type: ignore[arg-type]
        stop_token_ids=stop_token_ids,  # type: ignore[arg-type]
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty,
        ignore_eos=ignore_eos,
        return_logprob=return_logprob,
        top_logprobs_num=top_logprobs_num,
    )
    defaults.sampling_params()  # a bad default fails here, before any request
    return defaults


class Function:
    """A program: `func(s, *args, **kwargs)` appending to its state `s`."""

    def __init__(self, func: Callable[..., Any], bind_arguments: dict[str, Any] | None = None) -> None:
        if not callable(func):
            raise TypeError(f"pl.function decorates a function, got {type(func).__name__}")
        params = list(inspect.signature(func).parameters.values())
        if not params or params[0].kind not in (
            inspect.Parameter.POSITIONAL_ONLY,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
        ):
            raise TypeError(
                f"a pl.function takes the program state as its first argument: {func.__name__}(s, ...)"
            )
        self.func = func
        self.bind_arguments = dict(bind_arguments or {})
        self.arg_names = [p.name for p in params[1:]]
        self._signature = inspect.signature(func)
        functools.update_wrapper(self, func)

    def bind(self, **kwargs: Any) -> Function:
        """The same program with some arguments fixed."""
        unknown = [k for k in kwargs if k not in self.arg_names]
        if unknown:
            raise TypeError(f"{self.func.__name__}() has no argument {', '.join(map(repr, unknown))}")
        return Function(self.func, {**self.bind_arguments, **kwargs})

    def _arguments(self, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
        """All arguments by name, checked against the signature (a TypeError names the problem)."""
        bound = self._signature.bind(None, *args, **{**self.bind_arguments, **kwargs})
        bound.apply_defaults()
        named = dict(bound.arguments)
        named.pop(next(iter(self._signature.parameters)))
        return named

    def run(
        self,
        *args: Any,
        max_new_tokens: int = 128,
        stop: str | Sequence[str] = (),
        stop_token_ids: Sequence[int] = (),
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        min_p: float = 0.0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        ignore_eos: bool = False,
        return_logprob: bool | None = None,
        top_logprobs_num: int | None = None,
        stream: bool = False,
        backend: Backend | None = None,
        **kwargs: Any,
    ) -> ProgramState:
        """Run once. The sampling arguments are the defaults of every gen that does not set its own.
        With stream=True it returns at once; read with `state.text_iter()`."""
        defaults = _defaults(
            max_new_tokens,
            stop,
            stop_token_ids,
            temperature,
            top_p,
            top_k,
            min_p,
            frequency_penalty,
            presence_penalty,
            ignore_eos,
            return_logprob,
            top_logprobs_num,
        )
        named = self._arguments(args, kwargs)
        return run_program(self.func, _resolve_backend(backend), (), named, defaults, stream=stream)

    def run_batch(
        self,
        batch_kwargs: Sequence[dict[str, Any] | Sequence[Any]],
        *,
        max_new_tokens: int = 128,
        stop: str | Sequence[str] = (),
        stop_token_ids: Sequence[int] = (),
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        min_p: float = 0.0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        ignore_eos: bool = False,
        return_logprob: bool | None = None,
        top_logprobs_num: int | None = None,
        backend: Backend | None = None,
        num_threads: int | str = "auto",
        progress_bar: bool = False,
    ) -> list[ProgramState]:
        """Run one program per argument dict (or tuple of positional arguments), concurrently,
        after caching their common prefix. States come back in order."""
        if not isinstance(batch_kwargs, Sequence) or isinstance(batch_kwargs, str | bytes):
            raise TypeError("run_batch takes a list of argument dicts (or of argument tuples)")
        if num_threads == "auto":
            threads = MAX_BATCH_THREADS
        elif isinstance(num_threads, int) and not isinstance(num_threads, bool) and num_threads >= 1:
            threads = num_threads
        else:
            raise ValueError(f"num_threads must be 'auto' or an integer >= 1, got {num_threads!r}")
        defaults = _defaults(
            max_new_tokens,
            stop,
            stop_token_ids,
            temperature,
            top_p,
            top_k,
            min_p,
            frequency_penalty,
            presence_penalty,
            ignore_eos,
            return_logprob,
            top_logprobs_num,
        )
        batch = []
        for i, item in enumerate(batch_kwargs):
            try:
                if isinstance(item, dict):
                    batch.append(self._arguments((), item))
                elif isinstance(item, Sequence) and not isinstance(item, str | bytes):
                    batch.append(self._arguments(tuple(item), {}))
                else:
                    raise TypeError(f"expected a dict or a tuple of arguments, got {type(item).__name__}")
            except TypeError as exc:
                raise TypeError(f"run_batch item {i}: {exc}") from None
        if not batch:
            return []
        return run_program_batch(
            self.func,
            _resolve_backend(backend),
            batch,
            defaults,
            num_threads=threads,
            progress_bar=progress_bar,
        )

    def __call__(self, *args: Any, **kwargs: Any) -> ProgramState:
        return self.run(*args, **kwargs)

    def __repr__(self) -> str:
        return f"pl.function({self.func.__name__})"
