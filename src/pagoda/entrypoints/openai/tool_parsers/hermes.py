"""Hermes-style calls (Qwen2.5, Qwen3): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pagoda.entrypoints.openai.tool_parsers.base import (
    BlockResult,
    HeldBlock,
    JsonScanner,
    ToolParser,
    call_from_object,
)
from pagoda.structured.tags import CallSyntax

START, END = "<tool_call>", "</tool_call>"
SYNTAX = CallSyntax(begin=START + '\n{"name": "{name}", "arguments": ', end="}\n" + END, separator="\n")


class HermesParser(ToolParser):
    markers = (START,)

    def held_block(self) -> HeldBlock:
        return _Block(self.config.tools)


class _Block(HeldBlock):
    """``<tool_call>`` JSON object ``</tool_call>``: the object's end is found by its brackets, so
    ``</tool_call>`` inside a string does not end it."""

    def __init__(self, tools: Mapping[str, Any]) -> None:
        super().__init__()
        self._tools = tools
        self._scanner = JsonScanner()
        self._scanned = len(START)
        self._start = -1

    def feed(self, text: str, final: bool) -> BlockResult:
        self.raw += text
        if not self._scanner.done:
            before = self._scanned
            self._scanned += self._scanner.feed(self.raw[self._scanned :])
            if self._start < 0 and self._scanned > before:
                body = self.raw[len(START) : self._scanned]
                self._start = len(START) + len(body) - len(body.lstrip())
            if self._scanner.bad:
                return BlockResult("failed", self.raw)
            if not self._scanner.done:
                return BlockResult("failed", self.raw) if final else BlockResult("more")
        rest = self.raw[self._scanned :]
        tail = rest.lstrip()
        if not tail.startswith(END):
            if END.startswith(tail) and not final:
                return BlockResult("more")
            return BlockResult("failed", self.raw)
        try:
            obj = json.loads(self.raw[self._start : self._scanned])
        except json.JSONDecodeError:
            return BlockResult("failed", self.raw)
        call = call_from_object(obj, self._tools, ("arguments", "parameters"))
        if call is None:
            return BlockResult("failed", self.raw)
        return BlockResult("done", tail[len(END) :], [call])
