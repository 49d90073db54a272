"""Jump-forward decoding: append the text a grammar forces without sampling it token by token.

The forced string is turned into token ids the way the tokenizer itself would write them, so the sequence
looks like one the model could have decoded normally:

* The last generated token(s) are retokenized together with the forced string. If the tokenizer would
  merge the forced text into tokens already generated (e.g. ``"`` followed by forced ``name"`` is written
  ``"name``), no jump happens this step: earlier tokens stay as they are and the model decodes the next
  token itself under the grammar mask; the jump is tried again after it.
* The decoded bytes of the new tokens must equal the forced string exactly, and the grammar must accept
  every one of them; otherwise nothing is jumped and the matcher is left untouched.
* The final token is held back when the grammar allows a longer token that starts with it (normal
  decoding could write the end of the forced text and what follows as one token, e.g. ``"`` vs ``":``).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

import numpy as np
import torch

from pagoda.structured.interface import GrammarMatcher

# Trailing generated tokens retokenized with the forced text: enough to start on a whole UTF-8 character.
_MAX_CONTEXT_TOKENS = 4


def _prefix_upper_bound(prefix: bytes) -> bytes | None:
    """The smallest byte string greater than every string starting with ``prefix`` (None: no bound)."""
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return None
    return stripped[:-1] + bytes([stripped[-1] + 1])


class JumpForward:
    """Computes and accepts jump-forward tokens for matchers of one tokenizer.

    ``encode`` maps text to token ids without adding special tokens; ``token_bytes[i]`` is the UTF-8 bytes
    of token ``i`` (b"" for special tokens). Not thread-safe (one scratch bitmask row).
    """

    def __init__(
        self, encode: Callable[[str], Sequence[int]], token_bytes: Sequence[bytes], vocab_size: int
    ) -> None:
        self._encode = encode
        self._token_bytes = token_bytes
        by_bytes = sorted((b, i) for i, b in enumerate(token_bytes) if b)
        self._sorted_bytes = [b for b, _ in by_bytes]
        self._sorted_ids = np.array([i for _, i in by_bytes], dtype=np.int64)
        self._scratch = torch.full((1, (vocab_size + 31) // 32), -1, dtype=torch.int32)

    def __call__(
        self, matcher: GrammarMatcher, output_token_ids: Sequence[int], max_tokens: int | None = None
    ) -> list[int]:
        """Token ids to append after ``output_token_ids`` (already accepted into ``matcher``).

        The returned tokens have been accepted into ``matcher``; the caller appends them to the sequence
        as if sampled. At most ``max_tokens`` are returned. [] when there is nothing to jump.
        """
        if max_tokens is not None and max_tokens <= 0:
            return []
        forced = matcher.jump_forward_string()
        if not forced:
            return []
        context = self._context(output_token_ids)
        if context is None:
            return []
        context_text = b"".join(self._token_bytes[t] for t in context).decode("utf-8")
        ids = [int(t) for t in self._encode(context_text + forced)]
        if ids[: len(context)] != context:
            return []
        new = ids[len(context) :]
        if not new or b"".join(self._bytes_of(t) for t in new) != forced.encode("utf-8"):
            return []
        whole = max_tokens is None or len(new) <= max_tokens
        new = new if whole else new[:max_tokens]
        for n, token_id in enumerate(new[:-1]):
            if not matcher.accept_token(token_id):
                matcher.rollback(n)
                return []
        # A truncated jump ends on a boundary the tokenizer chose; only the end of the forced text is open.
        if whole and self._allows_extension(matcher, new[-1]):
            return new[:-1]
        if not matcher.accept_token(new[-1]):
            matcher.rollback(len(new) - 1)
            return []
        return new

    def _bytes_of(self, token_id: int) -> bytes:
        if 0 <= token_id < len(self._token_bytes):
            return self._token_bytes[token_id]
        return b""

    def _context(self, output_token_ids: Sequence[int]) -> list[int] | None:
        """The shortest tail of the output that decodes to whole UTF-8 characters; None if there is none."""
        if not output_token_ids:
            return []
        for n in range(1, min(_MAX_CONTEXT_TOKENS, len(output_token_ids)) + 1):
            tail = [int(t) for t in output_token_ids[-n:]]
            data = b"".join(self._bytes_of(t) for t in tail)
            if not self._bytes_of(tail[0]):
                return None
            try:
                data.decode("utf-8")
            except UnicodeDecodeError:
                continue
            return tail
        return None

    def _allows_extension(self, matcher: GrammarMatcher, token_id: int) -> bool:
        """Whether the grammar, in its current state, allows a token strictly longer than ``token_id``
        that starts with the same bytes."""
        prefix = self._token_bytes[token_id]
        lo = bisect.bisect_right(self._sorted_bytes, prefix)
        upper = _prefix_upper_bound(prefix)
        hi = len(self._sorted_bytes) if upper is None else bisect.bisect_left(self._sorted_bytes, upper)
        if lo >= hi:
            return False
        candidates = self._sorted_ids[lo:hi]
        matcher.fill_bitmask(self._scratch, 0)
        words = self._scratch[0].numpy().view(np.uint32)
        return bool(((words[candidates >> 5] >> (candidates & 31).astype(np.uint32)) & 1).any())
