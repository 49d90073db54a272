"""Prompt lookup decoding: the tokens that followed the latest earlier occurrence of the sequence's
last n tokens (n from prompt_lookup_max down to prompt_lookup_min, the longest match first)."""

from __future__ import annotations

from collections.abc import Sequence


def ngram_propose(tokens: Sequence[int], num_drafts: int, min_n: int, max_n: int) -> list[int]:
    """Up to `num_drafts` tokens continuing `tokens` as its longest repeated suffix did before.

    The most recent earlier match wins among equally long ones: a model that repeats itself
    repeats its latest loop. Empty when no suffix of at least `min_n` tokens occurred earlier."""
    length = len(tokens)
    if num_drafts < 1 or length < min_n + 1:
        return []
    tokens = list(tokens)
    last = tokens[-1]
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        # An earlier occurrence ends at position end - 1 < length - 1 and has a token after it.
        end = length - 1
        while True:
            try:
                end = _rindex(tokens, last, n - 1, end)
            except ValueError:
                break
            if tokens[end - n + 1 : end + 1] == suffix:
                return tokens[end + 1 : end + 1 + num_drafts]
    return []


def _rindex(tokens: list[int], value: int, lo: int, hi: int) -> int:
    """The last index i in [lo, hi) with tokens[i] == value (ValueError if none)."""
    for i in range(hi - 1, lo - 1, -1):
        if tokens[i] == value:
            return i
    raise ValueError(value)
