"""Mistral calls after ``[TOOL_CALLS]``: the v0.3 list ``[TOOL_CALLS] [{"name": ..., "arguments":
{...}}, ...]`` and the v11 form ``[TOOL_CALLS]name{...}`` (``[ARGS]`` and ``[CALL_ID]id`` between the
name and the arguments when the tokenizer shows them), one ``[TOOL_CALLS]`` per call. Call ids are
9 letters and digits, as Mistral's templates require; ids in the history that are not are mapped to
such ids (the same id always to the same one)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import string
from collections.abc import Mapping
from typing import Any

from pagoda.entrypoints.openai.tool_parsers.base import (
    BlockResult,
    HeldBlock,
    JsonScanner,
    ToolParser,
    arguments_json,
    call_from_object,
)
from pagoda.structured.tags import CallSyntax

MARKER = "[TOOL_CALLS]"
ARGS, CALL_ID = "[ARGS]", "[CALL_ID]"
LIST_SYNTAX = CallSyntax(
    open=MARKER + " [",
    begin='{"name": "{name}", "arguments": ',
    end="}",
    separator=", ",
    close="]",
    marker=MARKER,
)
ARGS_SYNTAX = CallSyntax(begin=MARKER + "{name}" + ARGS, end="")
NAME_SYNTAX = CallSyntax(begin=MARKER + "{name}", end="", marker=MARKER)
_NAME = re.compile(r"([A-Za-z0-9_.:-]+)(?:\[CALL_ID\]([A-Za-z0-9]*))?(\[ARGS\])?\s*")
_ID_PATTERN = re.compile(r"[A-Za-z0-9]{9}")
_ALPHANUMERIC = string.ascii_letters + string.digits


def syntax_from_rendering(rendered: str) -> CallSyntax:
    """The syntax a chat template writes a call in, from a rendering of a call to ``probe_fn``."""
    if MARKER + "probe_fn" + ARGS in rendered or MARKER + "probe_fn" + CALL_ID in rendered:
        return ARGS_SYNTAX
    if MARKER + "probe_fn{" in rendered:
        return NAME_SYNTAX
    tight = MARKER + "[" in rendered
    return dataclasses.replace(LIST_SYNTAX, open=MARKER + ("[" if tight else " ["))


class MistralParser(ToolParser):
    markers = (MARKER,)

    def held_block(self) -> HeldBlock:
        return _Block(self.config.tools)


class _Block(HeldBlock):
    def __init__(self, tools: Mapping[str, Any]) -> None:
        super().__init__()
        self._tools = tools
        self._form: str | None = None  # "list" or "name"
        self._name = ""
        self._start = 0
        self._scanner = JsonScanner()
        self._scanned = 0

    def feed(self, text: str, final: bool) -> BlockResult:
        self.raw += text
        if self._form is None:
            decided = self._decide(final)
            if decided is not None:
                return decided
        self._scanned += self._scanner.feed(self.raw[self._scanned :])
        if self._scanner.bad:
            return BlockResult("failed", self.raw)
        if not self._scanner.done:
            return BlockResult("failed", self.raw) if final else BlockResult("more")
        try:
            value = json.loads(self.raw[self._start : self._scanned])
        except json.JSONDecodeError:
            return BlockResult("failed", self.raw)
        calls = self._calls(value)
        if not calls:
            return BlockResult("failed", self.raw)
        return BlockResult("done", self.raw[self._scanned :], calls)

    def _decide(self, final: bool) -> BlockResult | None:
        body = self.raw[len(MARKER) :]
        stripped = body.lstrip()
        if not stripped:
            return BlockResult("failed", self.raw) if final else BlockResult("more")
        if stripped.startswith("["):
            self._form = "list"
            self._start = self._scanned = len(self.raw) - len(stripped)
            return None
        m = _NAME.match(body)
        if m is None:
            return BlockResult("failed", self.raw)
        rest = body[m.end() :]
        if not rest or (not final and any(t.startswith(rest) for t in (ARGS, CALL_ID))):
            return BlockResult("failed", self.raw) if final else BlockResult("more")
        if not rest.startswith("{"):
            return BlockResult("failed", self.raw)
        self._form, self._name = "name", m.group(1)
        self._start = self._scanned = len(MARKER) + m.end()
        return None

    def _calls(self, value: Any) -> list[tuple[str, str]]:
        if self._form == "name":
            arguments = arguments_json(value)
            if self._name not in self._tools or arguments is None:
                return []
            return [(self._name, arguments)]
        if not isinstance(value, list):
            return []
        calls = [call_from_object(item, self._tools, ("arguments", "parameters")) for item in value]
        return [] if any(c is None for c in calls) else calls  # type: ignore[misc]


def nine_char_id(call_id: str) -> str:
    """``call_id`` if it is 9 letters and digits, else 9 derived from it (stable, so that a call and
    its result keep matching)."""
    if _ID_PATTERN.fullmatch(call_id):
        return call_id
    number = int.from_bytes(hashlib.sha256(call_id.encode()).digest()[:8], "big")
    chars = []
    for _ in range(9):
        number, digit = divmod(number, len(_ALPHANUMERIC))
        chars.append(_ALPHANUMERIC[digit])
    return "".join(chars)


def prepare_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Call ids in the history as Mistral's templates accept them."""
    out = []
    for message in messages:
        message = dict(message)
        if message.get("tool_calls"):
            message["tool_calls"] = [
                {**call, "id": nine_char_id(call["id"])} if isinstance(call.get("id"), str) else call
                for call in message["tool_calls"]
            ]
        if isinstance(message.get("tool_call_id"), str):
            message["tool_call_id"] = nine_char_id(message["tool_call_id"])
        out.append(message)
    return out
