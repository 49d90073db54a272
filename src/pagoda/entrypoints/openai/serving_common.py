"""What the completion and chat handlers share: the server state (with its tokenizer thread),
request admission, client disconnects, SSE framing, usage and token texts for logprobs."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from pagoda.engine.async_engine import AsyncLLM, EngineDeadError, EngineOverloadedError, RequestStream
from pagoda.engine.input_processor import tokenize_prompt
from pagoda.entrypoints.openai.chat_settings import ChatSettings
from pagoda.entrypoints.openai.errors import APIError
from pagoda.entrypoints.openai.metrics import ServerMetrics
from pagoda.entrypoints.openai.protocol import (
    CompletionTokensDetails,
    ParamError,
    PromptTokensDetails,
    Usage,
)
from pagoda.limits import LimitError, RequestLimits, check_context
from pagoda.outputs import CompletionOutput, Logprob, RequestOutput
from pagoda.sampling_params import SamplingParams
from pagoda.structured.compile_pool import GrammarBusyError

T = TypeVar("T")


@dataclass
class ServerState:
    engine: AsyncLLM
    metrics: ServerMetrics
    model_names: list[str]  # the names clients may ask for; the first is reported back
    model_path: str
    api_key: str | None = None
    chat: ChatSettings = field(default_factory=ChatSettings)  # how chats are rendered and replies parsed
    limits: RequestLimits = field(default_factory=RequestLimits)
    max_body_size: int | None = None  # bytes; larger bodies get a 413
    # Tokenizer work of requests (prompts, chat templates, echoes, /tokenize, /detokenize) runs on
    # this one thread, never on the event loop, where a burst of long prompts would stall health
    # checks and streams. One thread, as vLLM's tokenizer executor: jobs finish in the order they
    # were queued, so requests reach the engine in that order (a handler submits to the engine
    # before its next await), and the tokenizer is used by two threads only (this and the engine's).
    _tokenizer_thread: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagoda-tokenizer")
    )
    _token_texts: dict[int, str] = field(default_factory=dict)  # the event loop's alone

    def resolve_model(self, name: str | None) -> str:
        if name is None or name in self.model_names:
            return name or self.model_names[0]
        raise APIError(
            f"the model {name!r} does not exist; this server serves {', '.join(map(repr, self.model_names))}",
            404,
            param="model",
            code="model_not_found",
        )

    async def off_loop(self, fn: Callable[[], T]) -> T:
        """`fn()` on the tokenizer thread; its exception (an APIError: a 400 naming the field) is
        raised here."""
        return await asyncio.wrap_future(self._tokenizer_thread.submit(fn))

    def shutdown(self) -> None:
        """Stop the tokenizer thread (queued jobs are dropped) and the engine."""
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)
        self.engine.shutdown()

    def tokenize(self, prompt: str | list[int], param: str = "prompt", tokenizer: Any = None) -> list[int]:
        """Validated prompt token ids; a 400 naming the problem (empty, bad ids, too long). Blocking:
        call it through `off_loop`. `tokenizer`: one that gives the engine tokenizer's ids faster
        (a HeadTokenizer)."""
        engine = self.engine
        try:
            self.limits.check_prompt(prompt, engine.max_model_len, param)  # before tokenizing
            _, ids = tokenize_prompt(
                tokenizer or engine.tokenizer, prompt, engine.vocab_size, engine.max_model_len
            )
        except ValueError as exc:
            raise APIError(str(exc), param=param) from None
        return ids

    def check_length(self, num_prompt_tokens: int, params: SamplingParams, param: str = "max_tokens") -> None:
        """The prompt plus max_tokens must fit the context: never truncated silently (as in vLLM,
        and as the engine checks for the offline LLM)."""
        try:
            check_context(
                num_prompt_tokens, params.max_tokens, params.min_tokens, self.engine.max_model_len, param
            )
        except LimitError as exc:
            raise APIError(str(exc), param=exc.param) from None

    def token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self.engine.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_texts[token_id] = text
        return text

    def decode(self, token_ids: list[int]) -> str:
        """Blocking for long inputs: call it through `off_loop`."""
        return self.engine.tokenizer.decode(token_ids, skip_special_tokens=False)

    async def start(
        self,
        request_ids: Sequence[str],
        prompts: Sequence[list[int]],
        params: SamplingParams,
        *,
        cache_salt: str | None,
        stream: bool,
    ) -> RequestStream:
        try:
            return await self.engine.add_requests(
                request_ids, prompts, params, cache_salt=cache_salt, stream=stream
            )
        except EngineOverloadedError as exc:
            raise APIError(str(exc), 503, code="server_overloaded") from None
        except EngineDeadError as exc:
            raise APIError(str(exc), 503, code="engine_unavailable") from None
        except GrammarBusyError as exc:
            raise APIError(str(exc), 503, code="server_overloaded") from None
        except ValueError as exc:
            raise APIError(str(exc), param=getattr(exc, "param", None)) from None


def json_response(body: BaseModel) -> Response:
    """A whole response, serialized by pydantic. (Returned as a model, FastAPI would walk it with its
    generic encoder on the event loop: 54 ms instead of 2 ms for 1,000 prompt logprobs.)"""
    return Response(body.model_dump_json(), media_type="application/json")


def param_error(exc: ParamError | LimitError, renamed: dict[str, str] | None = None) -> APIError:
    """A 400 naming the field; `renamed` maps SamplingParams names to this endpoint's field names."""
    param = exc.param if exc.param is None or renamed is None else renamed.get(exc.param, exc.param)
    return APIError(str(exc), param=param)


def check_logprob_start(params: SamplingParams, prompts: Sequence[list[int]]) -> None:
    """logprob_start_len must fall inside every prompt (a 400 naming it)."""
    start = params.logprob_start_len
    for ids in prompts:
        if start is not None and start >= len(ids):
            raise APIError(
                f"logprob_start_len ({start}) must be less than the prompt's length ({len(ids)} tokens)",
                param="logprob_start_len",
            )


def make_usage(
    num_prompt: int, num_completion: int, num_cached: int, prediction: tuple[int, int] | None = None
) -> Usage:
    """`prediction`: (accepted, rejected) prediction tokens of all choices, when a prediction was given."""
    return Usage(
        prompt_tokens=num_prompt,
        completion_tokens=num_completion,
        total_tokens=num_prompt + num_completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached),
        completion_tokens_details=None
        if prediction is None
        else CompletionTokensDetails(
            accepted_prediction_tokens=prediction[0], rejected_prediction_tokens=prediction[1]
        ),
    )


class PredictionCounts:
    """The latest (accepted, rejected) prediction counts of each choice of a response (outputs carry
    running totals), summed for its usage; None when the request had no prediction."""

    def __init__(self) -> None:
        self._latest: dict[object, tuple[int, int]] = {}

    def add(self, key: object, c: CompletionOutput) -> None:
        if c.accepted_prediction_tokens is not None:
            self._latest[key] = (c.accepted_prediction_tokens, c.rejected_prediction_tokens or 0)

    def totals(self) -> tuple[int, int] | None:
        if not self._latest:
            return None
        return sum(a for a, _ in self._latest.values()), sum(r for _, r in self._latest.values())


def top_entries(entry: dict[int, Logprob], n: int) -> list[tuple[int, Logprob]]:
    """The top-n tokens of one position, best first (the sampled token is listed first in `entry`
    whatever its rank, so it is filtered by rank like any other)."""
    ranked = [(tid, lp) for tid, lp in entry.items() if lp.rank is not None and lp.rank <= n]
    return sorted(ranked, key=lambda item: item[1].rank)[:n]


# ---- streaming and disconnects ----------------------------------------------------------------------
def sse(data: str) -> str:
    return f"data: {data}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class StreamResponse(StreamingResponse):
    """An SSE response that aborts its requests however it ends (done, client gone, cancelled),
    even when the body iterator never started."""

    def __init__(self, content: AsyncIterator[str], stream: RequestStream) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._stream.abort()


async def _client_gone(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | Response:
    """Await `work`, cancelling it if the client disconnects first (then returns an empty 499)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        return Response(status_code=499)
    return task.result()


class GenerationError(RuntimeError):
    """A completion ended with finish_reason "error" (the engine serves on; this request failed)."""


async def checked(stream: RequestStream) -> AsyncIterator[RequestOutput]:
    """The stream's outputs; raises GenerationError at the first completion that failed."""
    async for out in stream:
        for c in out.outputs:
            if c.finish_reason == "error":
                raise GenerationError(f"generation failed: {c.error}")
        yield out


async def collect(stream: RequestStream) -> list[RequestOutput]:
    """The final output of every request of a non-streamed RequestStream."""
    try:
        return [out async for out in checked(stream)]
    except EngineDeadError as exc:
        raise APIError(str(exc), 503, code="engine_unavailable") from None
    except GenerationError as exc:
        raise APIError(str(exc), 500, code="generation_error") from None


async def collect_unless_disconnected(
    request: Request, stream: RequestStream
) -> list[RequestOutput] | Response:
    """`collect(stream)`, or an empty 499 if the client disconnects first; the stream's requests are
    aborted however it ends."""
    try:
        return await unless_disconnected(request, collect(stream))
    finally:
        stream.abort()


def error_event(exc: Exception) -> str:
    """An error in the middle of a stream, as an SSE event (the status line is already sent)."""
    status = 503 if isinstance(exc, EngineDeadError) else 500
    code = "generation_error" if isinstance(exc, GenerationError) else None
    return sse(json.dumps(APIError(str(exc), status, code=code).body()))
