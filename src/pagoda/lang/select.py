"""`select`: score every choice by the logprobs of its tokens after the prompt, in one batched call.

The choices are scored as the text would continue: the prompt plus the choice is tokenized whole,
and the choice's tokens are those from the first position where that differs from the prompt's
own tokens (so a choice that merges with the prompt's last token scores the merged token). The
choices' requests reach the engine together; its scheduler has one compute the uncached prompt
while the others wait a step, then they find it cached, up to their own tokens.
"""

from __future__ import annotations

import math

from pagoda.lang.backend.base import Backend, ChoiceScore
from pagoda.lang.choices import ChoicesDecision, ChoicesSamplingMethod, TokenLogprob


def _same_context_same_value(contexts: list[list[tuple]], scored: list[list[float]]) -> list[list[float]]:
    """Give a token the same logprob in every choice where it follows the same tokens
    (`contexts[i][j]`: a key for the tokens up to and including choice i's token j). They are
    equal in exact arithmetic, but requests computed in different rows of a batch can differ in
    the last bits, and greedy_token_selection compares choices that share a first token exactly."""
    seen: dict[tuple, float] = {}
    return [
        [seen.setdefault(key, lp) for key, lp in zip(keys, lps, strict=True)]
        for keys, lps in zip(contexts, scored, strict=True)
    ]


def _contexts(i: int, c: ChoiceScore) -> list[tuple]:
    # Spans after the prompt's own tokens that start at one position follow the same tokens as
    # far as they agree; a span after other tokens is keyed by its choice alone.
    lead = (c.start,) if c.after_prompt else ("choice", i)
    return [(*lead, *c.token_ids[: j + 1]) for j in range(len(c.token_ids))]


def select(
    backend: Backend, prompt: str, choices: list[str], method: ChoicesSamplingMethod
) -> ChoicesDecision:
    scores = backend.score_choices(prompt, choices)
    scored = _same_context_same_value(
        [_contexts(i, c) for i, c in enumerate(scores)], [c.logprobs for c in scores]
    )
    input_token_logprobs: list[list[TokenLogprob]] = [
        [(lp, token, None) for token, lp in zip(c.token_ids, lps, strict=True)]
        for c, lps in zip(scores, scored, strict=True)
    ]
    normalized = [math.fsum(t[0] for t in tokens) / len(tokens) for tokens in input_token_logprobs]
    unconditional = None
    if method.requires_unconditional_logprobs:
        spans = [c.token_ids for c in scores]
        bare = _same_context_same_value(
            [[tuple(span[: j + 2]) for j in range(len(span) - 1)] for span in spans],
            backend.prompt_logprobs(spans, [1] * len(spans)),
        )
        unconditional = [
            [(None, span[0], None)] + [(lp, span[j + 1], None) for j, lp in enumerate(lps)]
            for span, lps in zip(spans, bare, strict=True)
        ]
    return method(
        choices=list(choices),
        normalized_prompt_logprobs=normalized,
        input_token_logprobs=input_token_logprobs,
        output_token_logprobs=[[] for _ in choices],
        unconditional_token_logprobs=unconditional,
    )
