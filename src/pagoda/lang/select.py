"""`select`: score every choice by the logprobs of its tokens after the prompt, in one batched call.

The choices are scored as the text would continue: the prompt plus the choice is tokenized whole,
and the choice's tokens are those from the first position where that differs from the prompt's
own tokens (so a choice that merges with the prompt's last token scores the merged token). The
choices' requests reach the engine together; its scheduler has one compute the uncached prompt
while the others wait a step, then they find it cached, up to their own tokens.
"""

from __future__ import annotations

import math

from pagoda.lang.backend.base import Backend
from pagoda.lang.choices import ChoicesDecision, ChoicesSamplingMethod, TokenLogprob


def _same_context_same_value(
    prompts: list[list[int]], starts: list[int], scored: list[list[float]]
) -> list[list[float]]:
    """Give a token the same logprob in every choice where it follows the same tokens. They are
    equal in exact arithmetic, but requests computed in different rows of a batch can differ in
    the last bits, and greedy_token_selection compares choices that share a first token exactly."""
    seen: dict[tuple[int, ...], float] = {}
    return [
        [seen.setdefault(tuple(ids[: start + j + 1]), lp) for j, lp in enumerate(lps)]
        for ids, start, lps in zip(prompts, starts, scored, strict=True)
    ]


def select(
    backend: Backend, prompt: str, choices: list[str], method: ChoicesSamplingMethod
) -> ChoicesDecision:
    full, starts, logprobs = backend.score_choices(prompt, choices)
    scored = _same_context_same_value(full, starts, logprobs)
    input_token_logprobs: list[list[TokenLogprob]] = [
        [(lp, ids[start + j], None) for j, lp in enumerate(lps)]
        for ids, start, lps in zip(full, starts, scored, strict=True)
    ]
    normalized = [math.fsum(t[0] for t in tokens) / len(tokens) for tokens in input_token_logprobs]
    unconditional = None
    if method.requires_unconditional_logprobs:
        spans = [ids[start:] for ids, start in zip(full, starts, strict=True)]
        bare = _same_context_same_value(
            spans, [1] * len(spans), backend.prompt_logprobs(spans, [1] * len(spans))
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
