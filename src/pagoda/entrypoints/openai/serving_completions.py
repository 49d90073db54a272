"""POST /v1/completions: one or more prompts, n samples each, streamed as SSE or returned whole."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import Response

from pagoda.engine.async_engine import RequestStream
from pagoda.entrypoints.openai import continuations
from pagoda.entrypoints.openai.limits import check_body, constraint_field
from pagoda.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    ParamError,
    new_id,
    now_s,
    prompt_logprobs_out,
)
from pagoda.entrypoints.openai.serving_common import (
    SSE_DONE,
    PredictionCounts,
    ServerState,
    StreamResponse,
    check_logprob_start,
    checked,
    collect_unless_disconnected,
    error_event,
    json_response,
    make_usage,
    param_error,
    sse,
    top_entries,
    unless_disconnected,
)
from pagoda.limits import LimitError
from pagoda.outputs import Logprob
from pagoda.sampling_params import SamplingParams
from pagoda.tokenizer.continuation import HeadTokenizer


@dataclass
class _Choice:
    """Per-choice state of a stream: the echoed prompt still to send, the logprob text offset."""

    echo: str | None  # None once sent
    offset: int = 0
    num_tokens: int = 0
    ids_sent: bool = False  # return_token_ids: the prompt's token ids went out


async def create_completion(state: ServerState, body: CompletionRequest, raw: Request) -> Response:
    try:
        body.check()
        model = state.resolve_model(body.model)
        prompts = body.prompts()
        check_body(state.limits, body, len(prompts))
        params = body.sampling_params(
            state.engine.vocab_size,
            body.max_tokens,
            body.logprobs,
            body.engine_prompt_logprobs(),
        )
        state.limits.check_params(params, constraint_field(body))
    except (ParamError, LimitError) as exc:
        raise param_error(exc) from None
    chars = body.logprob_start_char
    prompt_ids, echoes, head = await state.off_loop(
        lambda: _prepare(state, prompts, params, bool(body.echo), chars)
    )
    base_id = new_id("cmpl")
    request_ids = [f"{base_id}-{i}" for i in range(len(prompts))]
    starts: list[int] | None = None
    if chars is not None and head is not None:
        texts = [str(p) for p in prompts]  # body.check() refused token-id prompts
        spans = await state.off_loop(lambda: continuations.find_spans(state, texts, prompt_ids, chars, head))
        if spans.shared is not None and continuations.one_pass(body, params, spans):
            return await _scored_in_one_pass(state, body, raw, model, base_id, request_ids, prompt_ids, spans)
        starts = spans.starts
        params = continuations.general_params(params, spans)
    stream = await state.start(
        request_ids, prompt_ids, params, cache_salt=body.cache_salt, stream=bool(body.stream)
    )
    index_of = {rid: i for i, rid in enumerate(request_ids)}
    if body.stream:
        events = _stream(state, body, stream, model, base_id, index_of, echoes, prompt_ids)
        return StreamResponse(events, stream)
    result = await collect_unless_disconnected(raw, stream)
    if isinstance(result, Response):
        return result
    choices = []
    num_completion = num_cached = 0
    counts = PredictionCounts()
    for out in sorted(result, key=lambda o: index_of[o.request_id]):
        p = index_of[out.request_id]
        num_cached += out.num_cached_tokens
        for c in out.outputs:
            num_completion += len(c.token_ids)
            counts.add((p, c.index), c)
            logprobs = None
            if body.logprobs is not None:
                logprobs = CompletionLogprobs()
                offset = 0
                if body.echo:
                    offset = _add_logprobs(
                        state, logprobs, prompt_ids[p], out.prompt_logprobs, body.logprobs, 0
                    )
                _add_logprobs(state, logprobs, c.token_ids, c.logprobs, body.logprobs, offset)
            choices.append(
                CompletionChoice(
                    index=p * params.n + c.index,
                    text=echoes[p] + c.text,
                    logprobs=logprobs,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    prompt_logprobs=prompt_logprobs_out(
                        out.prompt_logprobs if starts is None else (out.prompt_logprobs or [])[starts[p] :]
                    ),
                    prompt_token_ids=prompt_ids[p] if body.return_token_ids else None,
                    token_ids=list(c.token_ids) if body.return_token_ids else None,
                    prompt_logprobs_start=None if starts is None else starts[p],
                )
            )
    choices.sort(key=lambda c: c.index)
    usage = make_usage(sum(map(len, prompt_ids)), num_completion, num_cached, counts.totals())
    return json_response(
        CompletionResponse(id=base_id, created=now_s(), model=model, choices=choices, usage=usage)
    )


async def _scored_in_one_pass(
    state: ServerState,
    body: CompletionRequest,
    raw: Request,
    model: str,
    base_id: str,
    request_ids: list[str],
    prompt_ids: list[list[int]],
    spans: continuations.Spans,
) -> Response:
    """logprob_start_char's scoring with each row computed once (continuations.score_one_pass).
    Usage counts every prompt's tokens; those the engine did not compute count as cached."""
    assert spans.shared is not None
    work = continuations.score_one_pass(state, request_ids, prompt_ids, spans.shared, body.cache_salt)
    scored = await unless_disconnected(raw, work)
    if isinstance(scored, Response):
        return scored
    ids = bool(body.return_token_ids)
    choices = [
        CompletionChoice(
            index=i,
            text="",
            finish_reason="length",
            prompt_logprobs=prompt_logprobs_out(one.entries),
            prompt_token_ids=prompt_ids[i] if ids else None,
            token_ids=[] if ids else None,
            prompt_logprobs_start=start,
        )
        for i, (one, start) in enumerate(zip(scored, spans.starts, strict=True))
    ]
    num_prompt = sum(map(len, prompt_ids))
    usage = make_usage(num_prompt, 0, num_prompt - sum(one.num_computed for one in scored))
    return json_response(
        CompletionResponse(id=base_id, created=now_s(), model=model, choices=choices, usage=usage)
    )


def _prepare(
    state: ServerState,
    prompts: list[str | list[int]],
    params: SamplingParams,
    echo: bool,
    logprob_start_char: int | None = None,
) -> tuple[list[list[int]], list[str], HeadTokenizer | None]:
    """The prompts' validated token ids and the texts to echo (blocking: the tokenizer thread's).
    With logprob_start_char, the first prompt's first N characters are tokenized once, and so is
    every prompt that continues them where the tokenizer allows (spliced onto their ids, the ids
    of a whole tokenization): that head comes back too."""
    head = None
    if logprob_start_char is not None:
        head = HeadTokenizer(state.engine.tokenizer, str(prompts[0])[:logprob_start_char])
    prompt_ids = [state.tokenize(p, tokenizer=head) for p in prompts]
    for ids in prompt_ids:
        state.check_length(len(ids), params)
    check_logprob_start(params, prompt_ids)
    echoes = [(p if isinstance(p, str) else state.decode(p)) if echo else "" for p in prompts]
    return prompt_ids, echoes, head


async def _stream(
    state: ServerState,
    body: CompletionRequest,
    stream: RequestStream,
    model: str,
    base_id: str,
    index_of: dict[str, int],
    echoes: list[str],
    prompt_ids: list[list[int]],
) -> AsyncIterator[str]:
    num_prompt = sum(map(len, prompt_ids))
    n = body.n
    created = now_s()
    opts = body.stream_options
    include_usage = opts is not None and opts.include_usage
    continuous = include_usage and opts is not None and opts.continuous_usage_stats
    choices = {p * n + i: _Choice(echoes[p]) for p in range(len(echoes)) for i in range(n)}
    cached: dict[str, int] = {}  # request id -> prompt tokens served by the prefix cache
    # The prompt's logprobs come with its first output; every sample's echo needs them.
    prompt_lps: dict[int, list] = {}
    counts = PredictionCounts()
    ids = bool(body.return_token_ids)
    try:
        async for out in checked(stream):
            cached[out.request_id] = out.num_cached_tokens
            p = index_of[out.request_id]
            if out.prompt_logprobs is not None:
                prompt_lps[p] = out.prompt_logprobs
            for c in out.outputs:
                index = p * n + c.index
                counts.add(index, c)
                state_c = choices[index]
                state_c.num_tokens += len(c.token_ids)
                echo = state_c.echo is not None
                text, state_c.echo = (state_c.echo or "") + c.text, None
                if not (text or c.token_ids or c.finish_reason):
                    continue
                logprobs = None
                if body.logprobs is not None:
                    logprobs = CompletionLogprobs()
                    if echo and body.echo:
                        state_c.offset = _add_logprobs(
                            state, logprobs, prompt_ids[p], prompt_lps.get(p), body.logprobs, 0
                        )
                    state_c.offset = _add_logprobs(
                        state, logprobs, c.token_ids, c.logprobs, body.logprobs, state_c.offset
                    )
                chunk = CompletionResponse(
                    id=base_id,
                    created=created,
                    model=model,
                    choices=[
                        CompletionChoice(
                            index=index,
                            text=text,
                            logprobs=logprobs,
                            finish_reason=c.finish_reason,
                            stop_reason=c.stop_reason,
                            prompt_token_ids=prompt_ids[p] if ids and not state_c.ids_sent else None,
                            token_ids=list(c.token_ids) if ids else None,
                        )
                    ],
                )
                state_c.ids_sent = True
                if continuous:
                    num_completion = sum(ch.num_tokens for ch in choices.values())
                    chunk.usage = make_usage(
                        num_prompt, num_completion, sum(cached.values()), counts.totals()
                    )
                yield sse(chunk.model_dump_json(exclude=None if include_usage else {"usage"}))
        if include_usage:
            num_completion = sum(ch.num_tokens for ch in choices.values())
            usage = make_usage(num_prompt, num_completion, sum(cached.values()), counts.totals())
            final = CompletionResponse(id=base_id, created=created, model=model, choices=[], usage=usage)
            yield sse(final.model_dump_json())
    except Exception as exc:
        yield error_event(exc)
    yield SSE_DONE


def _add_logprobs(
    state: ServerState,
    result: CompletionLogprobs,
    token_ids: list[int],
    entries: list[dict[int, Logprob] | None] | None,
    num: int,
    offset: int,
) -> int:
    """Append OpenAI's legacy logprobs of `token_ids` (`entries[i]` for token i; None where it has
    none, as the first prompt token) to `result`, text offsets from `offset`; returns the next offset."""
    entries = entries or []
    for i, token_id in enumerate(token_ids):
        entry = entries[i] if i < len(entries) else None
        text = state.token_text(token_id)
        result.tokens.append(text)
        result.text_offset.append(offset)
        offset += len(text)
        if entry is None:
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            continue
        result.token_logprobs.append(entry[token_id].logprob)
        top = {state.token_text(t): lp.logprob for t, lp in top_entries(entry, num)}
        top.setdefault(text, entry[token_id].logprob)
        result.top_logprobs.append(top)
    return offset
