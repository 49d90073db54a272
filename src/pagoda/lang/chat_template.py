"""Role prefixes and suffixes cut out of the model's own chat template.

A program's text is append-only: `pl.user(...)` appends the template's opening of a user turn,
the content, then its closing. Both come from rendering the template itself: the conversation so
far (its roles, with filler contents) and the same plus one turn whose content is a sentinel; the
new turn's text is what the second rendering adds, and the sentinel splits it into prefix and
suffix. So default system prompts, BOS text and per-position differences come out as the
template makes them. The cut is cached per (role, roles before it).

Templates that rewrite earlier turns when a new one follows (the rendering of the history is not
a prefix of the longer rendering) cannot be appended to and raise a ValueError.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from pagoda.lang.ir import ROLES

SENTINEL = "PAGODALANGTURNCONTENT"
_FILLER = "x"

Render = Callable[[list[dict[str, str]]], str]


class ChatTemplate:
    def __init__(self, render: Render, bos_text: str = "") -> None:
        """`render(messages)` is the template's text for a conversation (no generation prompt);
        `bos_text` is what tokenizing a prompt prepends by itself (e.g. '<|begin_of_text|>'), which
        the text must then not carry a second time."""
        self._render = render
        self._bos_text = bos_text
        self._cache: dict[tuple[str, tuple[str, ...]], tuple[str, str]] = {}
        self._lock = threading.Lock()

    def affixes(self, role: str, history: Sequence[str]) -> tuple[str, str]:
        """(prefix, suffix) of a `role` turn that follows turns of the roles in `history`."""
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; roles are {', '.join(ROLES)}")
        key = (role, tuple(history))
        with self._lock:
            cached = self._cache.get(key)
        if cached is not None:
            return cached
        before = [{"role": r, "content": _FILLER} for r in history]
        base = self._render(before) if before else ""
        full = self._render([*before, {"role": role, "content": SENTINEL}])
        if not full.startswith(base):
            raise ValueError(
                f"the chat template renders the earlier turns differently once a {role} turn follows "
                f"({' -> '.join(key[1]) or 'start'}), so a program cannot append to it"
            )
        turn = full[len(base) :]
        if turn.count(SENTINEL) != 1:
            raise ValueError(f"the chat template does not render a {role} turn's content verbatim")
        prefix, suffix = turn.split(SENTINEL)
        if not history and self._bos_text and prefix.startswith(self._bos_text):
            prefix = prefix[len(self._bos_text) :]  # the tokenizer adds it
        with self._lock:
            self._cache[key] = (prefix, suffix)
        return prefix, suffix
