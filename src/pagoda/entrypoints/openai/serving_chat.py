"""POST /v1/chat/completions: messages through the tokenizer's chat template, n samples."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from pagoda.engine.async_engine import RequestStream
from pagoda.entrypoints.openai.errors import APIError
from pagoda.entrypoints.openai.limits import check_body, constraint_field
from pagoda.entrypoints.openai.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatLogprobToken,
    ChatResponseMessage,
    DeltaMessage,
    ParamError,
    TopLogprob,
    new_id,
    now_s,
)
from pagoda.entrypoints.openai.serving_common import (
    SSE_DONE,
    ServerState,
    StreamResponse,
    collect,
    error_event,
    make_usage,
    param_error,
    sse,
    top_entries,
    unless_disconnected,
)
from pagoda.limits import LimitError
from pagoda.outputs import CompletionOutput


def chat_prompt_ids(state: ServerState, messages: list[dict], **template_kwargs) -> list[int]:
    try:
        state.limits.check_messages(messages, state.engine.max_model_len)  # before the template runs
        ids = state.engine.chat_prompt(messages, **template_kwargs)
    except ValueError as exc:
        raise APIError(str(exc), param="messages") from None
    return state.tokenize(ids, param="messages")


async def create_chat_completion(state: ServerState, body: ChatCompletionRequest, raw: Request) -> Response:
    try:
        body.check()
        model = state.resolve_model(body.model)
        max_tokens = body.max_tokens_requested()
        check_body(state.limits, body, 1)
        params = body.sampling_params(state.engine.vocab_size, max_tokens, body.num_logprobs())
        state.limits.check_params(params, constraint_field(body))
    except (ParamError, LimitError) as exc:
        raise param_error(exc, {"logprobs": "top_logprobs"}) from None
    prompt_ids = chat_prompt_ids(state, [m.to_dict() for m in body.messages])
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    state.check_length(len(prompt_ids), params, param)
    request_id = new_id("chatcmpl")
    stream = await state.start(
        [request_id], [prompt_ids], params, cache_salt=body.cache_salt, stream=bool(body.stream)
    )
    if body.stream:
        return StreamResponse(_stream(state, body, stream, model, request_id, len(prompt_ids)), stream)
    try:
        result = await unless_disconnected(raw, collect(stream))
    finally:
        stream.abort()
    if isinstance(result, Response):
        return result
    (out,) = result
    choices = [
        ChatChoice(
            index=c.index,
            message=ChatResponseMessage(content=c.text),
            logprobs=_logprobs(state, c, body.top_logprobs or 0) if body.logprobs else None,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )
        for c in out.outputs
    ]
    usage = make_usage(len(prompt_ids), sum(len(c.token_ids) for c in out.outputs), out.num_cached_tokens)
    return ChatCompletionResponse(id=request_id, created=now_s(), model=model, choices=choices, usage=usage)


async def _stream(
    state: ServerState,
    body: ChatCompletionRequest,
    stream: RequestStream,
    model: str,
    request_id: str,
    num_prompt: int,
) -> AsyncIterator[str]:
    created = now_s()
    opts = body.stream_options
    include_usage = opts is not None and opts.include_usage
    continuous = include_usage and opts is not None and opts.continuous_usage_stats
    exclude = None if include_usage else {"usage"}
    num_tokens = [0] * body.n
    num_cached = 0

    def chunk(choice: ChatChunkChoice) -> str:
        c = ChatCompletionChunk(id=request_id, created=created, model=model, choices=[choice])
        if continuous:
            c.usage = make_usage(num_prompt, sum(num_tokens), num_cached)
        return sse(c.model_dump_json(exclude=exclude))

    try:
        for i in range(body.n):
            yield chunk(ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content="")))
        async for out in stream:
            num_cached = out.num_cached_tokens
            for c in out.outputs:
                num_tokens[c.index] += len(c.token_ids)
                if not (c.text or c.finish_reason or (body.logprobs and c.token_ids)):
                    continue
                yield chunk(
                    ChatChunkChoice(
                        index=c.index,
                        delta=DeltaMessage(content=c.text)
                        if c.text or not c.finish_reason
                        else DeltaMessage(),
                        logprobs=_logprobs(state, c, body.top_logprobs or 0) if body.logprobs else None,
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                    )
                )
        if include_usage:
            usage = make_usage(num_prompt, sum(num_tokens), num_cached)
            final = ChatCompletionChunk(id=request_id, created=created, model=model, choices=[], usage=usage)
            yield sse(final.model_dump_json())
    except Exception as exc:
        yield error_event(exc)
    yield SSE_DONE


def _logprobs(state: ServerState, c: CompletionOutput, num: int) -> ChatLogprobs:
    content = []
    for token_id, entry in zip(c.token_ids, c.logprobs or [], strict=False):
        text = state.token_text(token_id)
        top = [
            TopLogprob(token=(t := state.token_text(tid)), logprob=lp.logprob, bytes=list(t.encode()))
            for tid, lp in top_entries(entry, num)
        ]
        content.append(
            ChatLogprobToken(
                token=text, logprob=entry[token_id].logprob, bytes=list(text.encode()), top_logprobs=top
            )
        )
    return ChatLogprobs(content=content)
