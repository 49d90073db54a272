"""Reasoning parsers under vLLM's names: the thought between ``<think>`` and ``</think>`` goes to
``reasoning_content``, the rest to ``content``.

Where the output starts is read off the prompt: a prompt that ends with an open ``<think>`` (the
template opened it) starts inside the thought; one that ends with ``</think>`` (thinking switched
off, e.g. Qwen3's ``enable_thinking: false``) has none. Otherwise ``qwen3`` finds a thought only if
the output opens one, and ``deepseek_r1`` reads the output as a thought until ``</think>`` (R1
always thinks; a leading ``<think>`` is dropped). A thought never closed is all reasoning.
"""

from __future__ import annotations

from typing import Literal

from pagoda.structured.tags import ThinkSpan

REASONING_PARSERS = ("qwen3", "deepseek_r1")
START, END = "<think>", "</think>"
PromptState = Literal["inside", "closed", "none"]

__all__ = [
    "REASONING_PARSERS",
    "ReasoningParser",
    "detect_reasoning_parser",
    "prompt_state",
    "think_span",
]


def detect_reasoning_parser(template: str) -> str | None:
    if START not in template:
        return None
    return "deepseek_r1" if "<｜Assistant｜>" in template else "qwen3"


def prompt_state(prompt_tail: str) -> PromptState:
    """Whether a prompt (its last characters) leaves the output inside a thought, after one, or
    neither."""
    tail = prompt_tail.rstrip()
    if tail.endswith(START):
        return "inside"
    if tail.endswith(END):
        return "closed"
    return "none"


def think_span(parser: str, state: PromptState) -> ThinkSpan | None:
    """The reasoning span a constrained answer must follow; None when the output has none."""
    if state == "closed":
        return None
    return ThinkSpan(START, END, opened=state == "inside" or parser == "deepseek_r1")


class ReasoningParser:
    """Splits streamed text into (reasoning, content); the split does not depend on how the text
    is cut into pieces. Newlines right after ``</think>`` are dropped."""

    def __init__(self, parser: str, state: PromptState) -> None:
        if parser not in REASONING_PARSERS:
            raise ValueError(
                f"unknown reasoning parser {parser!r}; choose one of {', '.join(REASONING_PARSERS)}"
            )
        if state == "closed":
            self._state = "content"
        elif state == "inside":
            self._state = "inside"
        else:
            # qwen3: a thought only if the output opens one; deepseek_r1: thinking from the start,
            # a leading <think> (if the model writes one) dropped.
            self._state = "open?" if parser == "qwen3" else "inside_start"
        self._buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        return self._run(final=False)

    def finish(self) -> tuple[str, str]:
        return self._run(final=True)

    def _run(self, final: bool) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        while self._buf:
            buf = self._buf
            if self._state in ("open?", "inside_start"):
                stripped = buf.lstrip()
                if stripped.startswith(START):
                    self._buf, self._state = stripped[len(START) :], "inside"
                    continue
                if START.startswith(stripped) and not final:
                    break  # may still become <think>
                if self._state == "open?":
                    self._state = "content"
                else:
                    self._state = "inside"
                continue
            if self._state == "inside":
                end = buf.find(END)
                if end >= 0:
                    reasoning.append(buf[:end])
                    self._buf, self._state = buf[end + len(END) :], "after"
                    continue
                keep = 0 if final else _partial_suffix(buf, END)
                reasoning.append(buf[: len(buf) - keep])
                self._buf = buf[len(buf) - keep :]
                break
            if self._state == "after":
                stripped = buf.lstrip("\n")
                self._buf = stripped
                if not stripped:
                    break
                self._state = "content"
                continue
            content.append(buf)
            self._buf = ""
        return "".join(reasoning), "".join(content)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
