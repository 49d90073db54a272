"""Where scored continuations start in token ids: the rule select and the server's
`logprob_start_char` scoring share (a continuation's tokens are those where prompt + continuation
tokenizes differently from the prompt alone)."""

from __future__ import annotations


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def span_start(prompt_ids: list[int], ids: list[int]) -> int:
    """Where a continuation's scored tokens start in its prompt + continuation tokens `ids`:
    after the tokens it shares with the prompt, but never at 0 (the first token has no logprob)
    and never past its last token (every continuation scores at least one token)."""
    return max(1, min(common_prefix_len(prompt_ids, ids), len(ids) - 1))


def choice_spans(prompt_ids: list[int], full_ids: list[list[int]]) -> list[int]:
    """`span_start` of each choice's prompt + choice tokens."""
    return [span_start(prompt_ids, ids) for ids in full_ids]


def shared_lead(full_ids: list[list[int]], start: int) -> int:
    """How many tokens from `start` on every sequence has in common, leaving each at least one
    token of its own: those a select's choices all start with."""
    n = min(len(ids) for ids in full_ids) - start - 1
    lead = 0
    while lead < n and all(ids[start + lead] == full_ids[0][start + lead] for ids in full_ids):
        lead += 1
    return lead
