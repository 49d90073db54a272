"""Qwen3-Coder's XML calls::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Parameter values are text: a string parameter (by the tool's schema) keeps its text (less the one
newline on each side); others are stripped and read as JSON where they parse (an enum's strings as
they are). The grammar writes string values as free text: their length and pattern limits are not
enforced in this format. Arguments are sent as the JSON
object of the values, one parameter at a time while streaming.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from pagoda.entrypoints.openai.tool_parsers.base import ArgumentScanner, BlockResult, HeldBlock, ToolParser
from pagoda.structured.tags import CallSyntax

START, END = "<tool_call>", "</tool_call>"
SYNTAX = CallSyntax(
    begin=START + "\n<function={name}>\n",
    end="</function>\n" + END,
    separator="\n",
    arguments="xml",
)
_PARAM_OPEN, _PARAM_CLOSE = "<parameter=", "</parameter>"
_CALL = re.compile(r"<tool_call>\s*<function=([^>\n]+)>(.*)</function>\s*</tool_call>", re.DOTALL)
_PARAM = re.compile(r"\s*<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


class Qwen3XmlParser(ToolParser):
    markers = (START,)

    def held_block(self) -> HeldBlock:
        return _Block(self.config.tools)

    def new_arguments(self, name: str) -> ArgumentScanner:
        return XmlArguments(self.config.tools.get(name))


def parameter_value(raw: str, schema: dict[str, Any] | None, key: str) -> Any:
    """A parameter's value: text for a string parameter, else JSON where it parses."""
    text = raw[1:] if raw.startswith("\n") else raw
    text = text[:-1] if text.endswith("\n") else text
    properties = schema.get("properties") if isinstance(schema, dict) else None
    prop = properties.get(key) if isinstance(properties, dict) else None
    prop = prop if isinstance(prop, dict) else {}
    if prop.get("type") in ("string", ["string"]):
        return text
    stripped = text.strip()
    if stripped in [v for v in prop.get("enum", []) if isinstance(v, str)] or stripped == prop.get("const"):
        return stripped
    try:
        return json.loads(stripped)
    except json.JSONDecodeError:
        return stripped


class XmlArguments(ArgumentScanner):
    """``<parameter=k>value</parameter>`` ... until the text is no parameter, streamed as a JSON
    object: ``{"k": `` once the name is known, the value once it ends, ``}`` at the end."""

    def __init__(self, schema: dict[str, Any] | None) -> None:
        self._schema = schema
        self._state = "between"  # "between", "name" (after <parameter=), "value"
        self._key = ""
        self._value = ""
        self._count = 0

    def feed(self, text: str) -> tuple[str, int]:
        out: list[str] = []
        i = 0
        while i < len(text) and not self.done:
            rest = text[i:]
            if self._state == "between":
                stripped = rest.lstrip(" \t\r\n")
                i += len(rest) - len(stripped)
                if not stripped:
                    break
                if stripped.startswith(_PARAM_OPEN):
                    i += len(_PARAM_OPEN)
                    self._state = "name"
                elif _PARAM_OPEN.startswith(stripped):
                    break  # could still open a parameter: wait (the caller keeps the rest)
                else:
                    out.append("}" if self._count else "{}")
                    self.done = True
            elif self._state == "name":
                close = rest.find(">")
                if close < 0:
                    self._key += rest
                    i = len(text)
                    break
                self._key += rest[:close]
                i += close + 1
                out.append(
                    ("{" if self._count == 0 else ", ") + json.dumps(self._key, ensure_ascii=False) + ": "
                )
                self._state, self._value = "value", ""
            else:
                search_from = max(0, len(self._value) - len(_PARAM_CLOSE) + 1)
                self._value += rest
                end = self._value.find(_PARAM_CLOSE, search_from)
                if end < 0:
                    i = len(text)
                    break
                # Characters of `rest` after the close tag go back to the loop.
                used = end + len(_PARAM_CLOSE) - (len(self._value) - len(rest))
                i += used
                value = parameter_value(self._value[:end], self._schema, self._key)
                out.append(json.dumps(value, ensure_ascii=False))
                self._count += 1
                self._state, self._key = "between", ""
        return "".join(out), i


class _Block(HeldBlock):
    def __init__(self, tools: Mapping[str, Any]) -> None:
        super().__init__()
        self._tools = tools

    def feed(self, text: str, final: bool) -> BlockResult:
        search_from = max(len(START), len(self.raw) - len(END) + 1)
        self.raw += text
        end = self.raw.find(END, search_from)
        if end < 0:
            return BlockResult("failed", self.raw) if final else BlockResult("more")
        end += len(END)
        m = _CALL.fullmatch(self.raw[:end])
        if m is None or m.group(1) not in self._tools:
            return BlockResult("failed", self.raw)
        name, body = m.group(1), m.group(2)
        schema = self._tools[name]
        arguments: dict[str, Any] = {}
        pos = 0
        while (p := _PARAM.match(body, pos)) is not None:
            arguments[p.group(1)] = parameter_value(p.group(2), schema, p.group(1))
            pos = p.end()
        if body[pos:].strip():
            return BlockResult("failed", self.raw)
        return BlockResult("done", self.raw[end:], [(name, json.dumps(arguments, ensure_ascii=False))])
