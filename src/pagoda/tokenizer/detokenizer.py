"""Incremental, UTF-8 safe detokenization of one completion's output tokens.

Each step decodes only a small window of token ids with the tokenizer's own decoder: a context part
(already emitted, ``window[:read]``) and the new part (``window[read:]``). The new text is the difference
between the two decodes, so decoder effects that depend on neighbouring tokens (the leading space of a
sentencepiece ``▁`` token, byte-level tokens that split a character) come out as in a full decode.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerBase

_REPLACEMENT_CHAR = "\ufffd"
# Emitted tokens kept as decoding context (the last prompt tokens for the first output tokens).
_CONTEXT_TOKENS = 6
# A character is at most 4 UTF-8 bytes, so in valid text one of the last few token boundaries ends a
# complete character.
_BOUNDARY_SEARCH_TOKENS = 4
# Above this many pending tokens the output is not valid UTF-8 (or carries no text): emit what decode
# gives and restart the window, so a broken stream cannot make each step slower than the last.
_MAX_PENDING_TOKENS = 32
# A tokenizer's special ids, built once per tokenizer (Llama 3 has 256 added tokens), not per request;
# kept with the vocabulary size they were read at, so tokens added later are seen.
_SPECIAL_IDS: weakref.WeakKeyDictionary[PreTrainedTokenizerBase, tuple[int, frozenset[int]]] = (
    weakref.WeakKeyDictionary()
)


def _special_ids(tokenizer: PreTrainedTokenizerBase, backend: Tokenizer, vocab_size: int) -> frozenset[int]:
    size, ids = _SPECIAL_IDS.get(tokenizer, (-1, frozenset()))
    if size != vocab_size:
        ids = frozenset(i for i, tok in backend.get_added_tokens_decoder().items() if tok.special)
        _SPECIAL_IDS[tokenizer] = (vocab_size, ids)
    return ids


class IncrementalDetokenizer:
    """Turns a stream of output token ids into text deltas.

    The concatenated deltas (plus ``flush()``) equal the decode of the output tokens in the context of
    the prompt: for byte-level BPE that is ``tokenizer.decode(output_ids)``; for sentencepiece-style
    tokenizers the first output token keeps the leading space a full decode of prompt + output gives it.
    A character split over several tokens is held back until complete, so deltas never contain a
    half character. ``clean_up_tokenization_spaces`` is never applied.

    Output that is not valid UTF-8 also matches decode for byte-level tokenizers, unless more than
    ``_MAX_PENDING_TOKENS`` tokens in a row end inside a character (then the text is released as is);
    for byte-fallback runs that turn out invalid, replacement characters may fall differently.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError(
                f"IncrementalDetokenizer needs a fast (tokenizers-backed) tokenizer, got {type(tokenizer).__name__}"
            )
        self._backend = backend
        self._skip_special_tokens = skip_special_tokens
        self._vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self._skipped_ids = (
            _special_ids(tokenizer, backend, self._vocab_size) if skip_special_tokens else frozenset()
        )
        # window[:read] is context whose text was emitted already; window[read:] is pending. Trimming
        # the prompt's last tokens to character boundaries decodes them, so it waits for the first
        # output (a prompt-only request, as a select's scoring ones, never has any).
        self._untrimmed: list[int] | None = self._prompt_tokens(prompt_token_ids)
        self._window: list[int] = []
        self._read = 0
        self._prefix_text: str | None = None
        self._finished = False

    def add(self, new_token_ids: Sequence[int]) -> str:
        """Appends output token ids and returns the newly completed text (possibly empty)."""
        if self._finished:
            raise ValueError("IncrementalDetokenizer.add() called after flush()")
        self._start()
        added = False
        for tid in new_token_ids:
            if tid < 0:
                raise ValueError(f"token ids must be non-negative, got {tid}")
            # Decode drops special tokens (when skipping) and ids outside the vocabulary; dropping them here
            # keeps the window small and gives the same text.
            if tid < self._vocab_size and tid not in self._skipped_ids:
                self._window.append(tid)
                added = True
        if not added:
            return ""
        return self._step()

    def flush(self) -> str:
        """Ends the stream: returns the held-back text as decode gives it (U+FFFD for an incomplete char)."""
        if self._finished:
            return ""
        self._finished = True
        if len(self._window) == self._read:
            return ""
        return self._advance(self._decode(self._window), len(self._window))

    def _step(self) -> str:
        full = self._decode(self._window)
        if self._complete(full):
            return self._advance(full, len(self._window))
        pending = len(self._window) - self._read
        # The last tokens end mid-character. If several arrived, emit up to the latest token boundary that
        # ends a complete character.
        depth = min(pending - 1, _BOUNDARY_SEARCH_TOKENS)
        for end in range(len(self._window) - 1, len(self._window) - 1 - depth, -1):
            text = self._decode(self._window[:end])
            if self._complete(text):
                return self._advance(text, end)
        if pending > _MAX_PENDING_TOKENS:
            return self._advance(full, len(self._window))
        return ""

    @staticmethod
    def _complete(text: str) -> bool:
        # A trailing U+FFFD may be the start of a character whose other bytes are still to come.
        return not text.endswith(_REPLACEMENT_CHAR)

    def _advance(self, text: str, end: int) -> str:
        """Emits ``text`` (the decode of window[:end]) past the context; window[read:end] becomes context."""
        delta = text[len(self._context_text()) :]
        pending = self._window[end:]
        context = self._window[self._read : end]
        if len(context) > _CONTEXT_TOKENS:
            context = self._trim_context(context)
        self._window = context + pending
        self._read = len(context)
        self._prefix_text = None
        return delta

    def _context_text(self) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._window[: self._read])
        return self._prefix_text

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self._backend.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _prompt_tokens(self, prompt_token_ids: Sequence[int]) -> list[int]:
        """The prompt's last _CONTEXT_TOKENS ids that decode to text."""
        context: list[int] = []
        for tid in reversed(prompt_token_ids):
            if len(context) == _CONTEXT_TOKENS:
                break
            if 0 <= tid < self._vocab_size and tid not in self._skipped_ids:
                context.append(tid)
        context.reverse()
        return context

    def _start(self) -> None:
        """The window's context: the prompt's last tokens on character boundaries (once)."""
        if self._untrimmed is not None:
            self._window = self._trim_context(self._untrimmed)
            self._read = len(self._window)
            self._untrimmed = None

    def _trim_context(self, context: list[int]) -> list[int]:
        """The last few tokens of ``context``, starting and ending on character boundaries (or none)."""
        context = context[-_CONTEXT_TOKENS:]
        # Diffing against a context that starts or ends inside a character would misplace the new text.
        for start in range(len(context)):
            text = self._decode(context[start:])
            if not text.startswith(_REPLACEMENT_CHAR):
                return [] if text.endswith(_REPLACEMENT_CHAR) else context[start:]
        return []
