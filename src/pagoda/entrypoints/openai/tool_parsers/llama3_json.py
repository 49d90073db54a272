"""Llama 3.1-3.3 JSON calls: ``{"name": ..., "parameters": {...}}`` as the whole reply, optionally
after ``<|python_tag|>``, several separated by ``; ``. Only a reply that starts with a call has calls:
JSON later in a reply is content."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from pagoda.entrypoints.openai.tool_parsers.base import (
    BlockResult,
    HeldBlock,
    JsonScanner,
    ParserConfig,
    ToolParser,
    call_from_object,
    openai_call_id,
)
from pagoda.structured.tags import CallSyntax

PYTHON_TAG = "<|python_tag|>"
SYNTAX = CallSyntax(begin='{"name": "{name}", "parameters": ', end="}", separator="; ")
_KEYS = ("name", "parameters", "arguments")
# The start of a call object: "{", then the first key, which must be one of _KEYS.
_FIRST_KEY = re.compile(r'\{\s*(?:"([a-z]*)("?))?')


class Llama3JsonParser(ToolParser):
    markers = (PYTHON_TAG,)

    def __init__(self, syntax: CallSyntax, config: ParserConfig, new_id=openai_call_id) -> None:
        super().__init__(syntax, config, new_id)
        self._position = "start"  # "start": only whitespace so far; "after_call"; "closed": no more calls

    def find_start(self, buf: str) -> tuple[int | None, int]:
        if self._position == "closed":
            return None, len(buf)
        j = len(buf) - len(buf.lstrip())
        rest = buf[j:]
        if not rest:
            return None, len(buf)
        if self._position == "start":
            if rest.startswith((PYTHON_TAG, "{")):
                return j, j
            if PYTHON_TAG.startswith(rest):
                return None, j
        elif rest.startswith(";"):
            return j, j
        self._position = "closed"
        return None, len(buf)

    def held_block(self) -> HeldBlock:
        return _Block(self.config.tools)

    def failed_skip(self, raw: str) -> int:
        return len(raw)  # not a call: the rest of the reply is content

    def on_block_end(self, ok: bool) -> None:
        self._position = "after_call" if ok else "closed"


class _Block(HeldBlock):
    """``[;] [<|python_tag|>] {...}``: one call object."""

    def __init__(self, tools: Mapping[str, Any]) -> None:
        super().__init__()
        self._tools = tools
        self._start = -1  # where the object starts in raw
        self._scanner = JsonScanner()
        self._scanned = 0

    def feed(self, text: str, final: bool) -> BlockResult:
        self.raw += text
        if self._start < 0:
            prefix = self.raw[1:].lstrip() if self.raw.startswith(";") else self.raw
            if prefix.startswith(PYTHON_TAG):
                prefix = prefix[len(PYTHON_TAG) :].lstrip()
            elif PYTHON_TAG.startswith(prefix) and prefix and not final:
                return BlockResult("more")
            if not prefix:
                return BlockResult("failed", self.raw) if final else BlockResult("more")
            if not prefix.startswith("{"):
                return BlockResult("failed", self.raw)
            self._start = self._scanned = len(self.raw) - len(prefix)
        if not _may_be_call(self.raw[self._start :]):
            return BlockResult("failed", self.raw)
        n = self._scanner.feed(self.raw[self._scanned :])
        self._scanned += n
        if not self._scanner.done:
            return BlockResult("failed", self.raw) if final else BlockResult("more")
        try:
            obj = json.loads(self.raw[self._start : self._scanned])
        except json.JSONDecodeError:
            return BlockResult("failed", self.raw)
        call = call_from_object(obj, self._tools, ("parameters", "arguments"))
        if call is None:
            return BlockResult("failed", self.raw)
        return BlockResult("done", self.raw[self._scanned :], [call])


def _may_be_call(text: str) -> bool:
    """Whether ``text`` (from the "{") can still be a call object, judging by its first key."""
    m = _FIRST_KEY.match(text)
    if m is None:
        return True
    key, closed = m.group(1), m.group(2)
    if key is None:
        return m.end() == len(text)  # only "{" and whitespace so far
    if closed:
        return key in _KEYS
    return m.end() == len(text) and any(k.startswith(key) for k in _KEYS)
