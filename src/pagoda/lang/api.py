"""The functions programs are written with: gen, select, roles, @function (SGLang's names)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pagoda.lang.backend.base import Backend
from pagoda.lang.choices import ChoicesSamplingMethod, token_length_normalized
from pagoda.lang.ir import Expr, ExprList, Gen, GenParams, RoleBegin, RoleEnd, Select, as_expr
from pagoda.lang.program import Function, get_default_backend

MAX_CHOICES = 256


def function(func: Callable[..., Any] | None = None) -> Any:
    """`@pl.function` (or `@pl.function()`): the decorated `func(s, ...)` becomes a program."""
    if func is not None:
        return Function(func)
    return Function


def _check_name(name: object, what: str) -> None:
    if name is not None and not (isinstance(name, str) and name):
        raise ValueError(f"{what} name must be a non-empty string or None, got {name!r}")


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    *,
    min_tokens: int | None = None,
    stop: str | Sequence[str] | None = None,
    stop_token_ids: Sequence[int] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    top_logprobs_num: int | None = None,
    dtype: Any = None,
    choices: Sequence[str] | None = None,
    regex: str | None = None,
    json_schema: str | dict[str, Any] | None = None,
) -> Gen:
    """Generate, and store the text as variable `name`. Unset sampling parameters take the
    program's defaults (`run(max_new_tokens=..., temperature=...)`). `regex`, `json_schema`,
    `choices` and `dtype` (int, float, bool, str) constrain the output through pagoda's
    structured output; `choices` here is a constrained walk, `pl.select` the exact argmax."""
    _check_name(name, "gen")
    params = GenParams(
        max_tokens=max_tokens,
        min_tokens=min_tokens,
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
        regex=regex,
        json_schema=json_schema,
        choices=choices,  # type: ignore[arg-type]
        dtype=dtype,
    )
    params.sampling_params()  # a bad value fails here, where it was written
    return Gen(name, params)


def gen_int(
    name: str | None = None,
    max_tokens: int | None = None,
    *,
    stop: str | Sequence[str] | None = None,
    stop_token_ids: Sequence[int] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    top_logprobs_num: int | None = None,
) -> Gen:
    """Generate an integer (optional sign, digits); the variable holds its text."""
    return gen(
        name,
        max_tokens,
        stop=stop,
        stop_token_ids=stop_token_ids,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty,
        ignore_eos=ignore_eos,
        return_logprob=return_logprob,
        top_logprobs_num=top_logprobs_num,
        dtype=int,
    )


def gen_string(
    name: str | None = None,
    max_tokens: int | None = None,
    *,
    stop: str | Sequence[str] | None = None,
    stop_token_ids: Sequence[int] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    top_logprobs_num: int | None = None,
) -> Gen:
    """Generate a double-quoted string literal (JSON escapes); the variable holds it, quotes included."""
    return gen(
        name,
        max_tokens,
        stop=stop,
        stop_token_ids=stop_token_ids,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty,
        ignore_eos=ignore_eos,
        return_logprob=return_logprob,
        top_logprobs_num=top_logprobs_num,
        dtype=str,
    )


def select(
    name: str | None = None,
    choices: Sequence[str] | None = None,
    temperature: float = 0.0,
    choices_method: ChoicesSamplingMethod = token_length_normalized,
) -> Select:
    """Choose one of `choices` by the logprobs of its tokens after the prompt (all choices scored in
    one batched call; the backend needs prompt logprobs), and store it as variable `name`."""
    _check_name(name, "select")
    if choices is None or isinstance(choices, str) or not isinstance(choices, Sequence):
        raise ValueError(f"select needs choices: a list of strings, got {choices!r:.80}")
    if not 1 <= len(choices) <= MAX_CHOICES:
        raise ValueError(f"select takes 1 to {MAX_CHOICES} choices, got {len(choices)}")
    if not all(isinstance(c, str) and c for c in choices):
        raise ValueError("select choices must be non-empty strings")
    if temperature != 0.0:
        raise ValueError(f"select supports temperature 0.0 only (the exact argmax), got {temperature}")
    if not isinstance(choices_method, ChoicesSamplingMethod):
        raise ValueError(
            "choices_method must be pl.token_length_normalized, pl.greedy_token_selection, "
            f"pl.unconditional_likelihood_normalized or another ChoicesSamplingMethod, got {choices_method!r}"
        )
    return Select(name, tuple(choices), temperature, choices_method)


def _role(role: str, expr: Expr | str | None) -> ExprList:
    if expr is None:
        return ExprList((RoleBegin(role), RoleEnd(role)))
    return RoleBegin(role) + as_expr(expr) + RoleEnd(role)


def system(expr: Expr | str | None = None) -> ExprList:
    return _role("system", expr)


def user(expr: Expr | str | None = None) -> ExprList:
    return _role("user", expr)


def assistant(expr: Expr | str | None = None) -> ExprList:
    """An assistant turn; a gen or select inside it continues the turn's opening (prefill)."""
    return _role("assistant", expr)


def system_begin() -> RoleBegin:
    return RoleBegin("system")


def system_end() -> RoleEnd:
    return RoleEnd("system")


def user_begin() -> RoleBegin:
    return RoleBegin("user")


def user_end() -> RoleEnd:
    return RoleEnd("user")


def assistant_begin() -> RoleBegin:
    return RoleBegin("assistant")


def assistant_end() -> RoleEnd:
    return RoleEnd("assistant")


def flush_cache(backend: Backend | None = None) -> bool:
    """Drop the backend's cached prefixes (the default backend's if none is given). False if there
    is no backend."""
    backend = backend if backend is not None else get_default_backend()
    if backend is None:
        return False
    backend.flush_cache()
    return True
