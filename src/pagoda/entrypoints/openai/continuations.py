"""`/v1/completions` with `logprob_start_char` (a pagoda extension): score each prompt's
continuation of its first N characters, in one request (pagoda.lang's select over HTTP).

Each prompt's scored span starts at its first token that differs from the tokens of its first N
characters tokenized alone (so a continuation that merges with the end of that text scores the
merged token), never before position 1, and holds at least the prompt's last token. The answer
carries only the span: `prompt_logprobs` from `prompt_logprobs_start` on.

When the request is a plain scoring request (max_tokens 0, prompt_logprobs 0, n 1, no echo or
logprobs) and every prompt continues one shared text token for token, the engine computes each
row once (`one_pass`): one prompt-only request for the shared text, and the tokens all
continuations start with (scored as its prompt logprobs), scores every continuation's next
token from its last row (`SamplingParams.next_token_ids`); then, for each continuation longer
than that, one prompt-only request of it without its last token, which finds the head cached,
scores the middle tokens as prompt logprobs and the last token from its last row. The logprobs are those the general path computes (same rows, same arithmetic); the general
path (any other request) scores every prompt from the earliest span start.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass

from pagoda.engine.async_engine import RequestStream
from pagoda.entrypoints.openai.errors import APIError
from pagoda.entrypoints.openai.protocol import CompletionRequest
from pagoda.entrypoints.openai.serving_common import ServerState, collect
from pagoda.outputs import Logprob, PromptLogprobs
from pagoda.sampling_params import SamplingParams
from pagoda.tokenizer.continuation import HeadTokenizer
from pagoda.tokenizer.spans import shared_lead, span_start


@dataclass(frozen=True)
class Spans:
    starts: list[int]  # per prompt: its first scored position
    # The shared text's token ids, when every prompt starts with the same text and continues its
    # tokens unchanged (each span starts right after them): what one_pass needs.
    shared: list[int] | None


def find_spans(
    state: ServerState, prompts: list[str], prompt_ids: list[list[int]], chars: int, head: HeadTokenizer
) -> Spans:
    """Where each prompt's scored span starts (blocking: the tokenizer thread's). `head`: the
    first prompt's leading text and its ids."""
    tokenizer = state.engine.tokenizer
    # one tokenization per distinct leading text
    contexts: dict[str, list[int]] = {head.head: head.head_ids if head.head else []}
    starts = []
    for text, ids in zip(prompts, prompt_ids, strict=True):
        if len(ids) < 2:
            raise APIError(
                "logprob_start_char needs prompts of two tokens or more (the first has no logprob)",
                param="logprob_start_char",
            )
        lead = text[:chars]
        context = contexts.get(lead)
        if context is None:
            context = contexts[lead] = list(tokenizer(lead)["input_ids"]) if lead else []
        starts.append(span_start(context, ids))
    shared = None
    if len(contexts) == 1:
        (context,) = contexts.values()
        n = len(context)
        if all(start == n and ids[:n] == context for start, ids in zip(starts, prompt_ids, strict=True)):
            shared = context
    return Spans(starts, shared)


def one_pass(body: CompletionRequest, params: SamplingParams, spans: Spans) -> bool:
    """Whether the request can be scored with each row computed once (see the module's doc)."""
    return (
        spans.shared is not None
        and params.max_tokens == 0
        and params.n == 1
        and params.prompt_logprobs == 0
        and not body.echo
        and body.logprobs is None
    )


@dataclass(frozen=True)
class Scored:
    entries: PromptLogprobs  # the span's entries, from its start
    num_computed: int  # prompt tokens the engine computed for this prompt's requests


async def score_one_pass(
    state: ServerState,
    request_ids: list[str],
    prompt_ids: list[list[int]],
    shared: list[int],
    cache_salt: str | None,
) -> list[Scored]:
    """Every prompt's span (which starts right after `shared`) scored with each row computed once.
    The head request is the shared text and the tokens every continuation starts with (those
    scored as its prompt logprobs); its last row scores each continuation's next token.
    Raises APIError as `collect` does; every request is aborted however this ends."""
    s = len(shared)
    lead = shared_lead(prompt_ids, s)
    h = s + lead  # the head's length: every prompt continues it by one token or more
    started: list[RequestStream] = []
    try:
        head_params = SamplingParams(
            max_tokens=0,
            next_token_ids=sorted({ids[h] for ids in prompt_ids}),
            **({"prompt_logprobs": 0, "logprob_start_len": s} if lead else {}),
        )
        head_stream = await state.start(
            [f"{request_ids[0]}-head"], [prompt_ids[0][:h]], head_params, cache_salt=cache_salt, stream=False
        )
        started.append(head_stream)
        (head,) = await collect(head_stream)
        longer = [i for i, ids in enumerate(prompt_ids) if len(ids) > h + 1]

        def tail_params(ids: list[int]) -> SamplingParams:
            # the middle tokens, if any, as prompt logprobs; the last one from the last row
            middle = {"prompt_logprobs": 0, "logprob_start_len": h + 1} if len(ids) > h + 2 else {}
            return SamplingParams(max_tokens=0, next_token_ids=[ids[-1]], **middle)

        # Queued together (each start waits for the engine thread to take its request), so that
        # the tails reach one step.
        starts = await asyncio.gather(
            *(
                state.start(
                    [request_ids[i]],
                    [prompt_ids[i][:-1]],
                    tail_params(prompt_ids[i]),
                    cache_salt=cache_salt,
                    stream=False,
                )
                for i in longer
            ),
            return_exceptions=True,
        )
        started += [x for x in starts if isinstance(x, RequestStream)]
        error = next((x for x in starts if isinstance(x, BaseException)), None)
        if error is not None:
            raise error
        collected = await asyncio.gather(*(collect(x) for x in starts if isinstance(x, RequestStream)))
        outs = {i: out for i, (out,) in zip(longer, collected, strict=True)}
    finally:
        for stream in started:
            stream.abort()
    ids0 = prompt_ids[0]
    head_entries = [{ids0[j]: _rank_kept(head.prompt_logprobs, j, ids0[j])} for j in range(s, h)]
    nexts = head.next_token_logprobs or {}
    result = []
    for i, ids in enumerate(prompt_ids):
        entries: PromptLogprobs = [*head_entries, {ids[h]: nexts[ids[h]]}]
        # the head is computed once: the first prompt counts it
        computed = h - head.num_cached_tokens if i == 0 else 0
        tail = outs.get(i)
        if tail is not None:
            entries += [
                {ids[j]: _rank_kept(tail.prompt_logprobs, j, ids[j])} for j in range(h + 1, len(ids) - 1)
            ]
            entries.append({ids[-1]: (tail.next_token_logprobs or {})[ids[-1]]})
            computed += len(ids) - 1 - tail.num_cached_tokens
        result.append(Scored(entries, computed))
    return result


def _rank_kept(entries: PromptLogprobs | None, j: int, token_id: int) -> Logprob:
    entry = entries[j] if entries is not None and j < len(entries) else None
    if entry is None:  # the engine scores every position from logprob_start_len on
        raise RuntimeError(f"no prompt logprob for token {token_id} at position {j}")
    return entry[token_id]


def general_params(params: SamplingParams, spans: Spans) -> SamplingParams:
    """The engine's parameters on the general path: prompt logprobs from the earliest span."""
    return dataclasses.replace(params, logprob_start_len=min(spans.starts))
