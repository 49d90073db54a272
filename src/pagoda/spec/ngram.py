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


class NgramIndex:
    """`ngram_propose` over one request's verified tokens, kept up to date a step at a time: an
    index of every `min_n`-gram's occurrences, so that a step costs O(new tokens + the earlier
    occurrences of the last `min_n` tokens looked at), not O(context). The same drafts as
    `ngram_propose(tokens, ...)` (tests/spec/test_ngram.py checks it)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self._ends: dict[tuple[int, ...], list[int]] = {}  # min_n tokens -> positions after each occurrence

    def extend(self, new: Sequence[int]) -> None:
        tokens, n = self.tokens, self.min_n
        for token in new:
            tokens.append(token)
            if len(tokens) >= n:
                self._ends.setdefault(tuple(tokens[-n:]), []).append(len(tokens))

    def propose(self, num_drafts: int, after: Sequence[int] = ()) -> list[int]:
        """Drafts to follow the indexed tokens and then `after` (drafts of an earlier proposer,
        not indexed: that rarer case searches the whole sequence)."""
        if after:
            return ngram_propose(self.tokens + list(after), num_drafts, self.min_n, self.max_n)
        tokens, length = self.tokens, len(self.tokens)
        if num_drafts < 1 or length < self.min_n + 1:
            return []
        best, best_n = None, 0
        for end in reversed(self._ends.get(tuple(tokens[length - self.min_n :]), ())):
            if end >= length:
                continue  # the suffix itself
            n = self.min_n  # extend the match backwards, up to max_n
            while n < self.max_n and end - n - 1 >= 0 and tokens[end - n - 1] == tokens[length - n - 1]:
                n += 1
            if n > best_n:  # the most recent among equally long ones
                best, best_n = end, n
                if n == self.max_n:
                    break
        return [] if best is None else tokens[best : best + num_drafts]
