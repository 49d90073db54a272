"""Tool-call formats under vLLM's parser names, and which one a chat template writes.

A format is the syntax the grammar writes calls in (``CallSyntax``), the parser that reads them
back, the strings the parser must see in the decoded text (markers that may be special tokens),
the call ids it hands out, and any rewriting of the history its template needs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagoda.entrypoints.openai.tool_parsers import hermes, llama3_json, mistral, qwen3_xml
from pagoda.entrypoints.openai.tool_parsers.base import (
    ParserConfig,
    ToolCall,
    ToolCallDelta,
    ToolDelta,
    ToolParser,
    merge_calls,
    nine_char_call_id,
    openai_call_id,
)
from pagoda.structured.tags import CallSyntax

__all__ = [
    "TOOL_PARSERS",
    "ParserConfig",
    "ToolCall",
    "ToolCallDelta",
    "ToolDelta",
    "ToolFormat",
    "ToolParser",
    "detect_tool_format",
    "merge_calls",
    "tool_format",
]


@dataclass(frozen=True)
class ToolFormat:
    name: str
    syntax: CallSyntax
    parser: type[ToolParser]
    visible: tuple[str, ...]  # must appear in the decoded text (shown even if special tokens)
    new_id: Callable[[], str] = openai_call_id
    prepare_messages: Callable[[list[dict[str, Any]]], list[dict[str, Any]]] | None = None

    def new_parser(self, config: ParserConfig) -> ToolParser:
        return self.parser(self.syntax, config, self.new_id)


TOOL_PARSERS: dict[str, ToolFormat] = {
    "hermes": ToolFormat("hermes", hermes.SYNTAX, hermes.HermesParser, (hermes.START, hermes.END)),
    "llama3_json": ToolFormat(
        "llama3_json", llama3_json.SYNTAX, llama3_json.Llama3JsonParser, (llama3_json.PYTHON_TAG,)
    ),
    "mistral": ToolFormat(
        "mistral",
        mistral.LIST_SYNTAX,
        mistral.MistralParser,
        (mistral.MARKER, mistral.ARGS, mistral.CALL_ID),
        new_id=nine_char_call_id,
        prepare_messages=mistral.prepare_messages,
    ),
    "qwen3_xml": ToolFormat(
        "qwen3_xml", qwen3_xml.SYNTAX, qwen3_xml.Qwen3XmlParser, (qwen3_xml.START, qwen3_xml.END)
    ),
}


def detect_tool_format(template: str) -> str | None:
    """The parser name for the call format a chat template writes, None if no parser knows it."""
    if "<function=" in template and "<parameter=" in template:
        return "qwen3_xml"
    if "<tool_call>" in template:
        return "hermes"
    if mistral.MARKER in template:
        return "mistral"
    if llama3_json.PYTHON_TAG in template or (
        "<|start_header_id|>" in template and '"parameters"' in template
    ):
        return "llama3_json"
    return None


def tool_format(name: str, render_probe: Callable[[], str | None] | None = None) -> ToolFormat:
    """The format called ``name``. ``render_probe`` renders a call to ``probe_fn`` with the model's
    chat template (None if the template cannot), which settles the variants of a family (Mistral's
    list or v11 form)."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of {', '.join(TOOL_PARSERS)}")
    fmt = TOOL_PARSERS[name]
    if name == "mistral" and render_probe is not None:
        rendered = render_probe()
        if rendered is not None:
            fmt = dataclasses.replace(fmt, syntax=mistral.syntax_from_rendering(rendered))
    return fmt
