"""Predicted outputs (OpenAI's `prediction` field): the predicted text's tokens are the drafts.

A request's `Prediction` keeps one alignment: the output verified so far ends where the prediction
reaches `cursor` (the drafts are the prediction's tokens from there). While the output follows the
prediction the cursor just moves on. After a mismatch (an edited span) the output's latest tokens
are looked up in the prediction, as prompt lookup does on the prompt: the longest match of up to
MATCH_MAX trailing tokens (at least MATCH_MIN), the first one at or after the old cursor preferred
(an edit goes forward through the text), and the drafts continue after it. No match: no drafts
until one is found.

The lookup is an index of the prediction's MATCH_MIN-grams made once per request, so a step costs
O(new tokens + matches of one key), never O(prediction).

Counts (`num_accepted`, `num_rejected`), as OpenAI's usage reports them: prediction tokens proposed
as drafts that verification kept, and those it rejected. Drafts end before a stop token (the
drafter's rule), so every kept draft is in the completion, except those after a stop string,
which the front end finds in the text.
"""

from __future__ import annotations

from collections.abc import Sequence

# Draft tokens per step from a prediction when `speculative_config` does not set
# num_speculative_tokens (a prediction turns drafting on for its request by itself).
PREDICTION_NUM_DRAFTS = 16
MATCH_MIN = 3  # fewer trailing tokens would re-align on every common token ("\n", "    ")
MATCH_MAX = 8


class Prediction:
    """One request's predicted output (its tokens) and where its output stands in it. Written by
    the drafter only (spec/drafter.py)."""

    def __init__(self, token_ids: Sequence[int]) -> None:
        self.token_ids = list(token_ids)
        # MATCH_MIN tokens -> the positions just after each occurrence, ascending.
        self._index: dict[tuple[int, ...], list[int]] = {}
        p = self.token_ids
        for end in range(MATCH_MIN, len(p) + 1):
            self._index.setdefault(tuple(p[end - MATCH_MIN : end]), []).append(end)
        self.cursor: int | None = 0  # output[:num_observed] ends at token_ids[:cursor]; None: lost
        self._last_cursor = 0  # where it was last aligned (the search prefers matches after it)
        self.num_observed = 0  # verified output tokens seen
        self.num_accepted = 0
        self.num_rejected = 0
        # The drafts proposed for the next step: (offset among the request's drafts, count).
        self.span: tuple[int, int] | None = None

    # ---- alignment -------------------------------------------------------------------------------
    def observe(self, new: Sequence[int], recent: Sequence[int]) -> None:
        """`new`: verified output tokens since the last call; `recent`: the output's last
        MATCH_MAX (or fewer) tokens, `new`'s included."""
        c = self.cursor
        if new:
            if c is not None and self.token_ids[c : c + len(new)] == list(new):
                self.cursor = c + len(new)
            else:
                self.cursor = self._find(recent)
            if self.cursor is not None:
                self._last_cursor = self.cursor
            self.num_observed += len(new)

    def propose(self, forced: Sequence[int], recent: Sequence[int], num_drafts: int) -> list[int]:
        """Up to `num_drafts` prediction tokens to follow the verified output and then `forced`
        (drafts an earlier proposer made); `recent` as in observe(). The alignment is not moved:
        drafts are not verified yet."""
        start = self.cursor
        if forced:
            forced = list(forced)
            if start is not None and self.token_ids[start : start + len(forced)] == forced:
                start += len(forced)
            else:
                start = self._find((list(recent) + forced)[-MATCH_MAX:])
        if start is None or num_drafts < 1:
            return []
        return self.token_ids[start : start + num_drafts]

    def _find(self, recent: Sequence[int]) -> int | None:
        """Where the longest match of `recent`'s trailing tokens ends in the prediction."""
        if len(recent) < MATCH_MIN:
            return None
        recent = list(recent[-MATCH_MAX:])
        ends = self._index.get(tuple(recent[-MATCH_MIN:]))
        if not ends:
            return None
        p, hint = self.token_ids, self._last_cursor
        best, best_len = None, 0
        for end in ends:
            n = MATCH_MIN
            while n < len(recent) and end - n - 1 >= 0 and p[end - n - 1] == recent[-n - 1]:
                n += 1
            # Longer wins; among equals the first at or after the hint, else the last before it.
            if n > best_len or (n == best_len and best < hint):
                best, best_len = end, n
        return best

    # ---- counts ----------------------------------------------------------------------------------
    def record_verified(self, num_drafts: int, num_accepted: int) -> None:
        """The request's drafts were verified (`num_drafts` of them, 0 when it had none or they
        were dropped): count the prediction's among them."""
        span, self.span = self.span, None
        if span is None or not num_drafts:
            return
        offset, count = span
        accepted = min(max(num_accepted - offset, 0), count)
        self.num_accepted += accepted
        self.num_rejected += count - accepted
