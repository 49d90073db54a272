"""What a program appends to its state: text, gen, select and role markers, and `+` to chain them.

The expressions are plain immutable values; the interpreter gives them meaning. A gen's sampling
parameters are kept as the user wrote them (None: "the program's default") and resolved into a
pagoda `SamplingParams` when the gen runs, so `run(temperature=0)` reaches every gen that does not
set its own.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagoda import SamplingParams, StructuredOutputs

if TYPE_CHECKING:
    from pagoda.lang.choices import ChoicesSamplingMethod

ROLES = ("system", "user", "assistant")

# The constraints behind gen_int / gen_string / gen(dtype=...): whole values, nothing around them.
REGEX_INT = r"[-+]?[0-9]+"
REGEX_FLOAT = r"[-+]?[0-9]+(\.[0-9]+)?"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r'"([^"\\\x00-\x1f]|\\["\\/bfnrt])*"'  # a JSON string literal
_DTYPE_REGEX = {
    int: REGEX_INT,
    "int": REGEX_INT,
    float: REGEX_FLOAT,
    "float": REGEX_FLOAT,
    bool: REGEX_BOOL,
    "bool": REGEX_BOOL,
    str: REGEX_STR,
    "str": REGEX_STR,
}


class Expr:
    """Base of everything `s += ...` accepts besides a str; `a + b` chains two into an ExprList."""

    def __add__(self, other: Expr | str) -> ExprList:
        return ExprList((*_items(self), *_items(as_expr(other))))

    def __radd__(self, other: Expr | str) -> ExprList:
        return ExprList((*_items(as_expr(other)), *_items(self)))


def as_expr(value: object) -> Expr:
    if isinstance(value, Expr):
        return value
    if isinstance(value, str):
        return Text(value)
    raise TypeError(
        "a program appends text (str) or pl.gen / pl.select / pl.system / pl.user / pl.assistant "
        f"expressions, got {type(value).__name__}"
    )


def _items(expr: Expr) -> tuple[Expr, ...]:
    return expr.items if isinstance(expr, ExprList) else (expr,)


@dataclass(frozen=True)
class Text(Expr):
    value: str


@dataclass(frozen=True)
class ExprList(Expr):
    items: tuple[Expr, ...]


@dataclass(frozen=True)
class RoleBegin(Expr):
    role: str


@dataclass(frozen=True)
class RoleEnd(Expr):
    role: str


@dataclass(frozen=True)
class GenParams:
    """A gen's sampling parameters as written; None means "the program's default" (see `run`)."""

    max_tokens: int | None = None
    min_tokens: int | None = None
    stop: tuple[str, ...] | None = None
    stop_token_ids: tuple[int, ...] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    ignore_eos: bool | None = None
    return_logprob: bool | None = None
    top_logprobs_num: int | None = None
    # Constraints (at most one), never taken from the program's defaults.
    regex: str | None = None
    json_schema: str | dict[str, Any] | None = None
    choices: tuple[str, ...] | None = None
    dtype: Any = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is not None:
            object.__setattr__(self, "stop", tuple(self.stop))
        if self.stop_token_ids is not None:
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.choices is not None:
            if isinstance(self.choices, str) or not isinstance(self.choices, Sequence):
                raise ValueError(f"choices must be a list of strings, got {self.choices!r:.80}")
            object.__setattr__(self, "choices", tuple(self.choices))
        if self.dtype is not None and self.dtype not in _DTYPE_REGEX:
            raise ValueError(
                f"dtype must be one of int, float, bool, str (or their names), got {self.dtype!r}"
            )
        if isinstance(self.json_schema, str):
            try:
                schema = json.loads(self.json_schema)
            except json.JSONDecodeError as exc:
                raise ValueError(f"json_schema is not valid JSON: {exc}") from None
            if not isinstance(schema, dict):
                raise ValueError("json_schema must be a JSON object (a schema)")
        elif self.json_schema is not None and not isinstance(self.json_schema, dict):
            raise ValueError(
                f"json_schema must be a JSON string or a dict, got {type(self.json_schema).__name__}"
            )
        given = [
            name for name in ("regex", "json_schema", "choices", "dtype") if getattr(self, name) is not None
        ]
        if len(given) > 1:
            raise ValueError(f"a gen takes at most one constraint; got {', '.join(given)}")

    def over(self, defaults: GenParams) -> GenParams:
        """These parameters, with the unset sampling ones taken from `defaults`."""
        changes = {
            f.name: getattr(defaults, f.name)
            for f in dataclasses.fields(self)
            if f.name not in _CONSTRAINTS and getattr(self, f.name) is None
        }
        return dataclasses.replace(self, **changes)

    def sampling_params(self) -> SamplingParams:
        """The pagoda SamplingParams of a resolved gen; ValueError names a bad value."""
        if self.top_logprobs_num is not None and not self.return_logprob:
            raise ValueError("top_logprobs_num needs return_logprob=True")
        if self.max_tokens == 0:  # SamplingParams takes 0 (a prompt alone); a gen generates
            raise ValueError("max_tokens must be an integer >= 1 for a gen, got 0")
        logprobs = (self.top_logprobs_num or 0) if self.return_logprob else None
        structured = None
        if self.regex is not None:
            structured = StructuredOutputs(regex=self.regex)
        elif self.json_schema is not None:
            structured = StructuredOutputs(json=self.json_schema)
        elif self.choices is not None:
            structured = StructuredOutputs(choice=list(self.choices))
        elif self.dtype is not None:
            structured = StructuredOutputs(regex=_DTYPE_REGEX[self.dtype])
        return SamplingParams(
            max_tokens=self.max_tokens,
            min_tokens=self.min_tokens or 0,
            stop=list(self.stop) if self.stop else None,
            stop_token_ids=list(self.stop_token_ids) if self.stop_token_ids else None,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            min_p=self.min_p or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            ignore_eos=bool(self.ignore_eos),
            logprobs=logprobs,
            structured_outputs=structured,
        )


_CONSTRAINTS = ("regex", "json_schema", "choices", "dtype")


@dataclass(frozen=True)
class Gen(Expr):
    name: str | None
    params: GenParams


@dataclass(frozen=True)
class Select(Expr):
    name: str | None
    choices: tuple[str, ...]
    temperature: float
    choices_method: ChoicesSamplingMethod
