"""What every tool-call parser shares: the streaming driver, canonical (grammar-shaped) call blocks,
and the types they hand out.

A parser is fed the model's text in pieces and returns what each piece settles: content, and tool
call deltas in OpenAI's form (``index``; ``id`` and ``name`` once; ``arguments`` fragments). The
same text gives the same result however it is split, and a non-streamed reply is the same machine
fed the whole text at once, so streamed and non-streamed replies agree.

A call block starts where the family says (a marker such as ``<tool_call>``, or the start of the
output). Two ways to read it:

* Canonical: the block is written exactly as the grammar writes it (``CallSyntax``: open, begin,
  arguments, end, ...) for a tool whose calls the grammar constrains. Its arguments then always
  parse, so they stream as they come.
* Held: anything else. The family's parser waits for the end of the block and checks it whole: a
  well-formed call of a known tool becomes a call (arguments sent at once), anything else (bad
  JSON, unknown name, a block cut off by the end of the output) becomes content, as it would
  without streaming.

Whitespace right before a call, and after the last call of a reply, is not content.
"""

from __future__ import annotations

import json
import secrets
import string
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pagoda.structured.tags import CallSyntax

Status = Literal["more", "done", "failed"]
_ALPHANUMERIC = string.ascii_letters + string.digits


@dataclass
class ToolCallDelta:
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ToolDelta:
    """What one piece of text settled."""

    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def add_call_text(self, index: int, text: str) -> None:
        if not text:
            return
        last = self.calls[-1] if self.calls else None
        if last is not None and last.index == index:
            last.arguments += text
        else:
            self.calls.append(ToolCallDelta(index, arguments=text))


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str


def merge_calls(deltas: list[ToolCallDelta]) -> list[ToolCall]:
    """The calls a sequence of deltas describes (the non-streamed form)."""
    calls: dict[int, ToolCall] = {}
    for d in deltas:
        call = calls.get(d.index)
        if call is None:
            calls[d.index] = ToolCall(d.id or "", d.name or "", d.arguments)
        else:
            call.arguments += d.arguments
    return [calls[i] for i in sorted(calls)]


@dataclass(frozen=True)
class ParserConfig:
    """The tools of one request (name -> JSON schema of the arguments, None if none given) and the
    tools whose calls the grammar constrains once their canonical begin is written."""

    tools: Mapping[str, dict[str, Any] | None]
    constrained: frozenset[str] = frozenset()


def openai_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def nine_char_call_id() -> str:
    """Mistral's tool call ids: 9 letters and digits."""
    return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))


def arguments_json(arguments: Any) -> str | None:
    """Arguments as OpenAI sends them (JSON text of an object); None if they are not an object (a
    JSON string holding an object counts, as some models write it)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return json.dumps(arguments, ensure_ascii=False)


def call_from_object(obj: Any, tools: Mapping[str, Any], names: tuple[str, ...]) -> tuple[str, str] | None:
    """``(name, arguments)`` from a ``{"name": ..., <one of names>: {...}}`` object of a known tool,
    else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in tools:
        return None
    keys = [k for k in names if k in obj]
    if len(keys) > 1:
        return None
    arguments = arguments_json(obj[keys[0]]) if keys else "{}"
    return None if arguments is None else (obj["name"], arguments)


class JsonScanner:
    """Finds where one JSON object or array ends, fed in pieces: brackets counted outside strings,
    escapes skipped. It does not validate; a block read whole is checked with ``json.loads``."""

    __slots__ = ("_depth", "_escape", "_in_string", "bad", "done")

    def __init__(self) -> None:
        self._depth = 0
        self._in_string = False
        self._escape = False
        self.done = False
        self.bad = False  # the value does not start with "{" or "["

    def feed(self, text: str) -> int:
        """Scan ``text``; returns how many of its characters belong to the value (all of them until
        it closes)."""
        for i, c in enumerate(text):
            if self._depth == 0:
                if c in " \t\r\n":
                    continue
                if c not in "{[":
                    self.bad = True
                    return i
                self._depth = 1
            elif self._in_string:
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self.done = True
                    return i + 1
        return len(text)


@dataclass
class BlockResult:
    status: Status
    leftover: str = ""  # "done": text after the block; "failed": the block's whole text
    calls: list[tuple[str, str]] = field(default_factory=list)  # held blocks: (name, arguments)


class HeldBlock(ABC):
    """A call block read whole: text goes in until the family can tell what it is."""

    def __init__(self) -> None:
        self.raw = ""

    @abstractmethod
    def feed(self, text: str, final: bool) -> BlockResult:
        """Take ``text`` (``final``: nothing follows). "more": all taken, need more; "done": a
        well-formed block, ``calls`` and ``leftover``; "failed": not a call block."""


class ArgumentScanner(ABC):
    """Streams the arguments of a canonical call as JSON text."""

    done = False

    @abstractmethod
    def feed(self, text: str) -> tuple[str, int]:
        """(JSON text to send, characters of ``text`` consumed); ``done`` once the arguments ended."""

    def finish(self) -> str:
        """JSON text still owed when the output ends inside the arguments."""
        return ""


class JsonArguments(ArgumentScanner):
    """Arguments written as a JSON object: sent as they are written."""

    def __init__(self) -> None:
        self._scanner = JsonScanner()

    def feed(self, text: str) -> tuple[str, int]:
        n = self._scanner.feed(text)
        self.done = self._scanner.done or self._scanner.bad
        return text[:n], n


def _match(buf: str, expected: str) -> Literal["match", "more", "mismatch"]:
    if buf.startswith(expected):
        return "match"
    return "more" if expected.startswith(buf) else "mismatch"


class CanonicalBlock:
    """A call block written as the grammar writes it: ``open begin(name) arguments end (separator
    begin(name) arguments end)* close``, for tools whose calls the grammar constrains. Calls stream as
    they come. ``feed`` returns None when the text turns out not to be canonical before the first
    call's name is known: nothing was emitted, and ``raw`` holds all the text taken, to be read as a
    held block instead."""

    def __init__(
        self,
        syntax: CallSyntax,
        names: frozenset[str],
        new_arguments: Callable[[str], ArgumentScanner],
        parser: ToolParser,
    ) -> None:
        self._syntax = syntax
        self._begins = {syntax.begin_for(n): n for n in names}
        self._new_arguments = new_arguments
        self._parser = parser
        self.raw = ""
        self._buf = ""
        self._phase = "open" if syntax.open else "begin"
        self._arguments: ArgumentScanner | None = None
        self._index = -1
        self._num_calls = 0
        self._separator = ""  # the separator taken before the begin being matched

    def feed(self, text: str, final: bool, out: ToolDelta) -> BlockResult | None:
        if self._num_calls == 0:
            self.raw += text
        self._buf += text
        while True:
            if self._phase == "open":
                state = _match(self._buf, self._syntax.open)
                if state == "mismatch" or (state == "more" and final):
                    return None
                if state == "more":
                    return BlockResult("more")
                self._take(len(self._syntax.open))
                self._phase = "begin"
            elif self._phase == "begin":
                begin = self._choose_begin(final)
                if begin is None:
                    if self._num_calls == 0:
                        return None
                    # Not another call after all: the block ended before the separator.
                    return BlockResult("done", self._separator + self._buf)
                if not begin:
                    return BlockResult("more")
                self._take(len(begin))
                self._start_call(self._begins[begin], out)
            elif self._phase == "arguments":
                assert self._arguments is not None
                fragment, n = self._arguments.feed(self._buf)
                self._take(n)
                out.add_call_text(self._index, fragment)
                if not self._arguments.done:
                    if final:
                        out.add_call_text(self._index, self._arguments.finish())
                        return BlockResult("done")
                    return BlockResult("more")
                self._phase = "end"
            elif self._phase == "end":
                state = _match(self._buf, self._syntax.end)
                if state == "mismatch" or (state == "more" and final):
                    return BlockResult("done", self._buf)
                if state == "more":
                    return BlockResult("more")
                self._take(len(self._syntax.end))
                self._phase = "after"
            else:  # after a call: the close, or a separator and the next call, or nothing more
                close, separator = self._syntax.close, self._syntax.separator
                if close and self._buf.startswith(close):
                    self._take(len(close))
                    return BlockResult("done", self._buf)
                if separator and self._buf.startswith(separator):
                    self._take(len(separator))
                    self._separator, self._phase = separator, "begin"
                    continue
                undecided = any(
                    e and len(e) > len(self._buf) and e.startswith(self._buf) for e in (close, separator)
                )
                if undecided and not final:
                    return BlockResult("more")
                return BlockResult("done", self._buf)

    def _take(self, n: int) -> None:
        self._buf = self._buf[n:]

    def _choose_begin(self, final: bool) -> str | None:
        """The begin the buffer starts with ("" while undecided), None if no constrained tool's can
        match. A begin that is a prefix of another waits for the text to tell them apart."""
        buf = self._buf
        if not final and any(len(b) > len(buf) and b.startswith(buf) for b in self._begins):
            return ""
        complete = [b for b in self._begins if buf.startswith(b)]
        return max(complete, key=len) if complete else None

    def _start_call(self, name: str, out: ToolDelta) -> None:
        self._index = self._parser.next_index()
        out.calls.append(ToolCallDelta(self._index, self._parser.new_id(), name, ""))
        self._arguments = self._new_arguments(name)
        self._phase = "arguments"
        self._num_calls += 1
        self._separator = ""


class ToolParser(ABC):
    """The streaming driver. Families set ``markers`` (strings that start a call block) and
    ``held_block()``; ``find_start`` is overridden where blocks start elsewhere (Llama)."""

    markers: tuple[str, ...] = ()

    def __init__(self, syntax: CallSyntax, config: ParserConfig, new_id: Callable[[], str] = openai_call_id):
        self.syntax = syntax
        self.config = config
        self.new_id = new_id
        self._buf = ""
        self._block: CanonicalBlock | HeldBlock | None = None
        # Trailing whitespace of the content, held until it is known not to precede a call.
        self._pending_ws = ""
        self._ws_before_block = ""
        self._after_call = False
        self._num_calls = 0

    # ---- family hooks --------------------------------------------------------------------------------
    def find_start(self, buf: str) -> tuple[int | None, int]:
        """(where a call block starts in ``buf``, or None; from where text must be held back, as it
        may be the beginning of a block)."""
        starts = [i for m in self.markers if (i := buf.find(m)) >= 0]
        if starts:
            return min(starts), min(starts)
        hold = len(buf)
        for marker in self.markers:
            for k in range(min(len(marker) - 1, len(buf)), 0, -1):
                if buf.endswith(marker[:k]):
                    hold = min(hold, len(buf) - k)
                    break
        return None, hold

    @abstractmethod
    def held_block(self) -> HeldBlock:
        """A new block of this family's calls, read whole."""

    def new_arguments(self, name: str) -> ArgumentScanner:
        return JsonArguments()

    def failed_skip(self, raw: str) -> int:
        """How much of a failed block's text is content before looking for the next block."""
        starts = [len(m) for m in self.markers if raw.startswith(m)]
        return max(starts) if starts else max(1, len(raw))

    def on_block_end(self, ok: bool) -> None:  # noqa: B027 (a hook: most families need nothing)
        """A call block ended, well-formed or not (Llama allows a next one only right after a call)."""

    # ---- driver --------------------------------------------------------------------------------------
    def next_index(self) -> int:
        self._num_calls += 1
        return self._num_calls - 1

    @property
    def num_calls(self) -> int:
        return self._num_calls

    def feed(self, text: str) -> ToolDelta:
        out = ToolDelta()
        self._buf += text
        self._run(out, final=False)
        return out

    def finish(self) -> ToolDelta:
        out = ToolDelta()
        self._run(out, final=True)
        if not self._after_call:
            out.content += self._pending_ws
        self._pending_ws = ""
        return out

    def _run(self, out: ToolDelta, final: bool) -> None:
        while True:
            if self._block is None:
                start, hold = self.find_start(self._buf)
                if start is None:
                    end = len(self._buf) if final else hold
                    self._text(out, self._buf[:end])
                    self._buf = self._buf[end:]
                    return
                self._text(out, self._buf[:start])
                self._ws_before_block, self._pending_ws = self._pending_ws, ""
                self._buf = self._buf[start:]
                if self.config.constrained:
                    self._block = CanonicalBlock(
                        self.syntax, self.config.constrained, self.new_arguments, self
                    )
                else:
                    self._block = self.held_block()
            text, self._buf = self._buf, ""
            result = self._feed_block(text, final, out)
            if result.status == "more":
                assert not final, "a block is settled once the output ends"
                return
            self._block = None
            if result.status == "done":
                for name, arguments in result.calls:
                    out.calls.append(ToolCallDelta(self.next_index(), self.new_id(), name, arguments))
                self._after_call = True
                self._buf = result.leftover
                self.on_block_end(ok=True)
            else:
                skip = self.failed_skip(result.leftover)
                self._pending_ws = self._ws_before_block
                self._text(out, result.leftover[:skip])
                self._buf = result.leftover[skip:]
                self.on_block_end(ok=False)
            self._ws_before_block = ""

    def _feed_block(self, text: str, final: bool, out: ToolDelta) -> BlockResult:
        block = self._block
        if isinstance(block, CanonicalBlock):
            result = block.feed(text, final, out)
            if result is not None:
                return result
            # Not written as the grammar writes it: read the same text as a held block.
            self._block = held = self.held_block()
            return held.feed(block.raw, final)
        assert isinstance(block, HeldBlock)
        return block.feed(text, final)

    def _text(self, out: ToolDelta, text: str) -> None:
        if not text:
            return
        stripped = text.rstrip(" \t\r\n")
        if stripped:
            out.content += self._pending_ws + stripped
            self._pending_ws = ""
            self._after_call = False
        self._pending_ws += text[len(stripped) :]
