"""POST /v1/chat/completions: messages through the model's chat template, n samples; replies parsed
into content, reasoning and tool calls (see chat_reply)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from pagoda.engine.async_engine import RequestStream
from pagoda.entrypoints.openai.chat_render import RenderedChat, render_chat
from pagoda.entrypoints.openai.chat_reply import ChoiceDelta, ReplyPlan, plan_reply
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
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCallOut,
    ParamError,
    ToolCallOut,
    TopLogprob,
    new_id,
    now_s,
    prompt_logprobs_out,
)
from pagoda.entrypoints.openai.reasoning import prompt_state
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
)
from pagoda.entrypoints.openai.tool_parsers import merge_calls
from pagoda.limits import LimitError
from pagoda.outputs import CompletionOutput


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
    try:
        state.limits.check_messages(body.messages, state.engine.max_model_len)  # before the template runs
    except LimitError as exc:
        raise param_error(exc) from None
    rendered, prompt_ids = await state.off_loop(lambda: _render(state, body))
    try:
        plan = plan_reply(body, state.chat, prompt_state(rendered.tail), params.skip_special_tokens)
        if plan.tools_constrain and plan.structured is not None:  # built from the request's tools
            state.limits.check_structured(plan.structured, "tools")
    except (ParamError, LimitError) as exc:
        raise param_error(exc) from None
    if plan.tools_constrain and params.min_tokens:
        raise APIError(
            "min_tokens cannot be combined with a tool choice the grammar enforces", param="min_tokens"
        )
    params = dataclasses.replace(
        params,
        structured_outputs=plan.structured,
        skip_special_tokens=params.skip_special_tokens and plan.hidden is None,
    )
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    state.check_length(len(prompt_ids), params, param)
    check_logprob_start(params, [prompt_ids])
    request_id = new_id("chatcmpl")
    try:
        stream = await state.start(
            [request_id], [prompt_ids], params, cache_salt=body.cache_salt, stream=bool(body.stream)
        )
    except APIError as exc:
        if exc.status == 400 and plan.tools_constrain and exc.param is None:
            raise APIError(
                f"the tools' parameters cannot be enforced: {exc.message}", param="tools"
            ) from None
        raise
    if body.stream:
        return StreamResponse(_stream(state, body, plan, stream, model, request_id, len(prompt_ids)), stream)
    result = await collect_unless_disconnected(raw, stream)
    if isinstance(result, Response):
        return result
    (out,) = result
    choices = []
    for c in out.outputs:
        parser = plan.new_choice()
        parsed = parser.feed(c.text)
        rest = parser.finish()
        calls = merge_calls(parsed.calls + rest.calls)
        content = parsed.content + rest.content
        reasoning = (parsed.reasoning + rest.reasoning) or None
        message = ChatResponseMessage(
            content=None if calls and not content else content,
            reasoning_content=reasoning,
            reasoning=reasoning,
            tool_calls=[
                ToolCallOut(id=call.id, function=FunctionCallOut(name=call.name, arguments=call.arguments))
                for call in calls
            ],
        )
        choices.append(
            ChatChoice(
                index=c.index,
                message=message,
                logprobs=_logprobs(state, c, body.top_logprobs or 0) if body.logprobs else None,
                finish_reason=_finish_reason(c.finish_reason, bool(calls), plan.named),
                stop_reason=c.stop_reason,
            )
        )
    counts = PredictionCounts()
    for c in out.outputs:
        counts.add(c.index, c)
    num_completion = sum(len(c.token_ids) for c in out.outputs)
    usage = make_usage(len(prompt_ids), num_completion, out.num_cached_tokens, counts.totals())
    return json_response(
        ChatCompletionResponse(
            id=request_id,
            created=now_s(),
            model=model,
            choices=choices,
            usage=usage,
            prompt_logprobs=prompt_logprobs_out(out.prompt_logprobs),
        )
    )


def _render(state: ServerState, body: ChatCompletionRequest) -> tuple[RenderedChat, list[int]]:
    """The rendered chat and its validated prompt ids (blocking: the tokenizer thread's)."""
    rendered = render_chat(state.engine.tokenizer, state.chat, body.messages, body)
    return rendered, state.tokenize(rendered.prompt_ids, param="messages")


def _finish_reason(reason: str | None, has_calls: bool, named: bool) -> str | None:
    """OpenAI's: "tool_calls" when a reply that chose to call tools ended with calls; a named tool
    choice ends with "stop"."""
    return "tool_calls" if reason == "stop" and has_calls and not named else reason


def _delta_message(delta: ChoiceDelta, finished: bool) -> DeltaMessage:
    fields: dict = {}
    if delta.content:
        fields["content"] = delta.content
    if delta.reasoning:
        fields["reasoning_content"] = fields["reasoning"] = delta.reasoning
    calls: list[DeltaToolCall] = []
    for d in delta.calls:
        if calls and calls[-1].index == d.index and d.id is None:
            previous = calls[-1].function
            previous.arguments = (previous.arguments or "") + d.arguments
            continue
        calls.append(
            DeltaToolCall(
                index=d.index,
                id=d.id,
                type="function" if d.id is not None else None,
                function=DeltaFunctionCall(name=d.name, arguments=d.arguments),
            )
        )
    if calls:
        fields["tool_calls"] = calls
    if not fields and not finished:
        fields["content"] = ""
    return DeltaMessage(**fields)


async def _stream(
    state: ServerState,
    body: ChatCompletionRequest,
    plan: ReplyPlan,
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
    counts = PredictionCounts()
    parsers = [plan.new_choice() for _ in range(body.n)]

    def chunk(choice: ChatChunkChoice) -> str:
        c = ChatCompletionChunk(id=request_id, created=created, model=model, choices=[choice])
        if continuous:
            c.usage = make_usage(num_prompt, sum(num_tokens), num_cached, counts.totals())
        return sse(c.model_dump_json(exclude=exclude))

    try:
        for i in range(body.n):
            yield chunk(ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content="")))
        async for out in checked(stream):
            num_cached = out.num_cached_tokens
            for c in out.outputs:
                num_tokens[c.index] += len(c.token_ids)
                counts.add(c.index, c)
                parser = parsers[c.index]
                delta = parser.feed(c.text)
                if c.finish_reason:
                    rest = parser.finish()
                    delta = ChoiceDelta(
                        delta.reasoning + rest.reasoning,
                        delta.content + rest.content,
                        delta.calls + rest.calls,
                    )
                if not (delta or c.finish_reason or (body.logprobs and c.token_ids)):
                    continue
                yield chunk(
                    ChatChunkChoice(
                        index=c.index,
                        delta=_delta_message(delta, bool(c.finish_reason)),
                        logprobs=_logprobs(state, c, body.top_logprobs or 0) if body.logprobs else None,
                        finish_reason=_finish_reason(c.finish_reason, parser.num_calls > 0, plan.named),
                        stop_reason=c.stop_reason,
                    )
                )
        if include_usage:
            usage = make_usage(num_prompt, sum(num_tokens), num_cached, counts.totals())
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
