"""Structural tags for the chat API: tool calls in a model family's own syntax, and constraints that
start only after a reasoning span.

A structural tag (``StructuredOutputs(structural_tag=...)``) strings free text, tagged regions and
constrained parts together; the backend compiles it like any other spec. The builders here know
nothing of model families: a family describes how it writes calls (``CallSyntax``) and what it
thinks in (``ThinkSpan``), and gets back a spec.

What each tool choice allows (every call is ``begin(name) arguments end``):

* ``required``: ``open call (separator call)* close`` and nothing else (one call if not parallel);
  every tool's arguments follow its schema.
* ``named``: ``open call close`` for that one tool, arguments by its schema.
* ``auto``: free text. A call of a ``strict`` tool is constrained once its ``begin`` has been
  written; other tools' calls stay free. A syntax with a ``marker`` (one string that starts every
  call block, e.g. Mistral's ``[TOOL_CALLS]``) constrains every call after the marker, the strict
  tools' arguments by schema and the others' to any JSON object. Not parallel: at most one call,
  and the output ends after it, so every tool's call is constrained (others to any JSON object).
  Nothing to constrain (parallel, no strict tool): no spec at all.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pagoda.sampling_params import StructuredOutputs
from pagoda.structured.spec import parse_json_schema, parse_structural_tag

# The arguments of a tool without a schema (or a non-strict one under auto): any JSON object.
ANY_OBJECT: dict[str, Any] = {"type": "object", "additionalProperties": True}
# Whitespace a model may write between the end of its reasoning and the constrained answer.
_AFTER_THINKING = r"\n{0,2}"
# Free whitespace around XML-style parameter values (newlines as Qwen3-Coder writes them), capped so
# that a weak model cannot pad forever.
_XML_MAX_WHITESPACE = 2


@dataclass(frozen=True)
class ToolSchema:
    """One tool as the grammar sees it: its name, its arguments' JSON schema (None: any object) and
    whether ``auto`` constrains its calls (OpenAI's ``strict``)."""

    name: str
    parameters: dict[str, Any] | None = None
    strict: bool = False


@dataclass(frozen=True)
class CallSyntax:
    """How one model family writes tool calls. ``{name}`` in ``begin`` stands for the tool's name.

    ``open`` / ``close`` wrap a block of calls (Mistral v0.3's ``[TOOL_CALLS] [`` ... ``]``), and
    ``separator`` goes between two calls. ``marker``, when set, starts every call block and is what
    ``auto`` waits for (needed when calls cannot be told apart by their ``begin``); without it each
    tool's ``begin`` is its own trigger. ``arguments``: a JSON object, or Qwen3-Coder's XML
    parameters (``<parameter=k>value</parameter>``).
    """

    begin: str
    end: str
    separator: str = ""
    open: str = ""
    close: str = ""
    marker: str | None = None
    arguments: Literal["json", "xml"] = "json"

    def __post_init__(self) -> None:
        if "{name}" not in self.begin:
            raise ValueError(f"CallSyntax.begin must contain {{name}}, got {self.begin!r}")
        if self.marker is not None and not (
            self.open.startswith(self.marker) or (not self.open and self.begin.startswith(self.marker))
        ):
            raise ValueError("CallSyntax.marker must start the open string, or every call's begin")

    def begin_for(self, name: str) -> str:
        return self.begin.replace("{name}", name)


@dataclass(frozen=True)
class ThinkSpan:
    """A reasoning span ``start ... end`` before the answer. ``opened``: the prompt ends inside it
    (the output starts with the reasoning); otherwise the output may begin with a whole span."""

    start: str = "<think>"
    end: str = "</think>"
    opened: bool = False


def tool_call_constraint(
    syntax: CallSyntax,
    tools: Sequence[ToolSchema],
    choice: Literal["auto", "required", "named"],
    *,
    name: str | None = None,
    parallel: bool = True,
    think: ThinkSpan | None = None,
) -> StructuredOutputs | None:
    """The spec enforcing ``choice`` over ``tools`` (see the module docstring); None when ``auto``
    leaves every call free. ``name`` is the tool of a ``named`` choice. ValueError for an unknown
    name or an empty tool list."""
    if not tools:
        raise ValueError("tool_call_constraint needs at least one tool")
    by_name = {tool.name: tool for tool in tools}
    if len(by_name) != len(tools):
        raise ValueError("tool names must be unique")
    if choice == "named":
        if name not in by_name:
            raise ValueError(f"the named tool {name!r} is not among the tools")
        body = _block(syntax, [_call(syntax, by_name[name], constrain=True)], at_least_one=True, single=True)
    elif choice == "required":
        calls = [_call(syntax, tool, constrain=True) for tool in tools]
        body = _block(syntax, calls, at_least_one=True, single=not parallel)
    elif choice == "auto":
        body = _auto(syntax, tools, parallel)
        if body is None:
            return None
    else:
        raise ValueError(f"unknown tool choice {choice!r}")
    return _structural_tag(_after_thinking(body, think))


def answer_after_thinking(answer: StructuredOutputs, think: ThinkSpan) -> StructuredOutputs:
    """``answer`` applied only after the reasoning span (the span itself is free text)."""
    return _structural_tag(_after_thinking(_answer_format(answer), think))


# ---- formats ---------------------------------------------------------------------------------------
def _structural_tag(fmt: dict[str, Any]) -> StructuredOutputs:
    # Keys keep their order: a schema's properties are generated in the order it declares them.
    tag = {"type": "structural_tag", "format": fmt}
    return StructuredOutputs(structural_tag=json.dumps(tag, ensure_ascii=False))


def _const(text: str) -> dict[str, Any]:
    return {"type": "const_string", "value": text}


def _sequence(*parts: dict[str, Any] | None) -> dict[str, Any]:
    elements = [p for p in parts if p is not None]
    return elements[0] if len(elements) == 1 else {"type": "sequence", "elements": elements}


def _arguments(syntax: CallSyntax, tool: ToolSchema, constrain: bool) -> dict[str, Any]:
    schema = tool.parameters if constrain and tool.parameters is not None else ANY_OBJECT
    if syntax.arguments == "xml":
        return {
            "type": "json_schema",
            "json_schema": schema,
            "style": "qwen_xml",
            "max_whitespace_cnt": _XML_MAX_WHITESPACE,
        }
    return {"type": "json_schema", "json_schema": schema}


def _call(syntax: CallSyntax, tool: ToolSchema, constrain: bool) -> dict[str, Any]:
    return {
        "type": "tag",
        "begin": syntax.begin_for(tool.name),
        "content": _arguments(syntax, tool, constrain),
        "end": syntax.end,
    }


def _calls(
    syntax: CallSyntax, calls: list[dict[str, Any]], at_least_one: bool, single: bool
) -> dict[str, Any]:
    return {
        "type": "tags_with_separator",
        "tags": calls,
        "separator": syntax.separator,
        "at_least_one": at_least_one,
        "stop_after_first": single,
    }


def _block(
    syntax: CallSyntax, calls: list[dict[str, Any]], at_least_one: bool, single: bool
) -> dict[str, Any]:
    return _sequence(
        _const(syntax.open) if syntax.open else None,
        _calls(syntax, calls, at_least_one, single),
        _const(syntax.close) if syntax.close else None,
    )


def _auto(syntax: CallSyntax, tools: Sequence[ToolSchema], parallel: bool) -> dict[str, Any] | None:
    if parallel and not any(tool.strict for tool in tools):
        return None
    if syntax.marker is None:
        # Every tool's begin is its own trigger; only the calls that must be constrained get one.
        chosen = [tool for tool in tools if tool.strict or not parallel]
        return {
            "type": "triggered_tags",
            "triggers": [syntax.begin_for(tool.name) for tool in chosen],
            "tags": [_call(syntax, tool, constrain=tool.strict) for tool in chosen],
            "stop_after_first": not parallel,
        }
    marker = syntax.marker
    if syntax.open:
        # One marker opens a block holding all the calls (its close ends the tag).
        block = _sequence(
            _const(syntax.open[len(marker) :]) if len(syntax.open) > len(marker) else None,
            _calls(syntax, [_call(syntax, t, constrain=t.strict) for t in tools], True, not parallel),
        )
        tags = [{"type": "tag", "begin": marker, "content": block, "end": syntax.close}]
    else:
        # Each call starts with the marker.
        tags = [_call(syntax, tool, constrain=tool.strict) for tool in tools]
    return {"type": "triggered_tags", "triggers": [marker], "tags": tags, "stop_after_first": not parallel}


def _after_thinking(body: dict[str, Any], think: ThinkSpan | None) -> dict[str, Any]:
    if think is None:
        return body
    thought = {"type": "any_text", "excludes": [think.end]}
    if think.opened:
        span: dict[str, Any] = {"type": "tag", "begin": "", "content": thought, "end": think.end}
    else:
        span = {
            "type": "optional",
            "content": {"type": "tag", "begin": think.start, "content": thought, "end": think.end},
        }
    return _sequence(span, {"type": "regex", "pattern": _AFTER_THINKING}, body)


def _answer_format(spec: StructuredOutputs) -> dict[str, Any]:
    if spec.json is not None:
        return {"type": "json_schema", "json_schema": parse_json_schema(spec.json)}
    if spec.json_object:
        return {"type": "json_schema", "json_schema": ANY_OBJECT}
    if spec.regex is not None:
        return {"type": "regex", "pattern": spec.regex}
    if spec.choice is not None:
        return {"type": "or", "elements": [_const(c) for c in spec.choice]}
    if spec.grammar is not None:
        return {"type": "grammar", "grammar": spec.grammar}
    assert spec.structural_tag is not None  # StructuredOutputs holds exactly one constraint
    return parse_structural_tag(spec.structural_tag)["format"]
