"""AsyncLLM: the engine stepped on one background thread, with an asyncio stream per request.

Every LLMEngine call happens on the engine thread (the engine is not thread-safe). Callers on any
asyncio loop send commands through a thread-safe queue; the thread drains it, steps, and hands the
outputs to each request's asyncio queue with `loop.call_soon_threadsafe`. When nothing is left to
run, the thread blocks on the command queue instead of spinning.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pagoda.config import EngineArgs
from pagoda.engine.input_processor import Prompt
from pagoda.engine.llm_engine import LLMEngine
from pagoda.engine.messages import StepStats
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams
from pagoda.structured import CompiledGrammar

logger = logging.getLogger(__name__)

# Called on the engine thread after each step (and after aborts) with the outputs produced and what
# the step did (the core's stats snapshot and each touched request's token counts and timings).
StepCallback = Callable[[list[RequestOutput], StepStats], None]
# Called on the engine thread once it died of an error, after every listener has been told.
ErrorCallback = Callable[[BaseException], None]


class EngineDeadError(RuntimeError):
    """The engine thread stopped (shut down, or a step raised); no request can be served."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue already holds `max_waiting_requests` requests."""


class _Sink:
    """An asyncio queue that the engine thread feeds."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Any] = asyncio.Queue()

    def put(self, item: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody is listening
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


_ACCEPTED = object()  # first item of a sink: the engine took the requests


@dataclass
class _Add:
    request_ids: list[str]
    prompts: list[Prompt]
    params: SamplingParams
    cache_salt: str | None
    stream: bool
    sink: _Sink
    grammar: CompiledGrammar | None = None


@dataclass
class _Call:
    """Run `fn(engine)` on the engine thread; its result or exception goes to `future`."""

    fn: Callable[[LLMEngine], Any]
    future: concurrent.futures.Future


@dataclass
class _Abort:
    request_ids: list[str]


_STOP = object()


class RequestStream:
    """The outputs of one or more requests added together, in the order they are produced.

    With stream=True each output is a delta (only the new text / tokens); otherwise one cumulative
    output per request when it finishes. Iteration ends when every request finished. Leaving it
    early (break, cancellation, `async with` exit) must be followed by `abort()`.
    """

    def __init__(self, engine: AsyncLLM, request_ids: list[str], sink: _Sink) -> None:
        self.request_ids = request_ids
        self._engine = engine
        self._sink = sink
        self._pending = set(request_ids)

    @property
    def finished(self) -> bool:
        return not self._pending

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._pending:
            raise StopAsyncIteration
        item = await self._sink.queue.get()
        if isinstance(item, BaseException):
            self._pending.clear()
            raise item
        if item.finished:
            self._pending.discard(item.request_id)
        return item

    def abort(self) -> None:
        """Abort the requests still running (idempotent); their blocks are freed at once."""
        if self._pending:
            self._engine._submit(_Abort(sorted(self._pending)))
            self._pending.clear()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.abort()


class AsyncLLM:
    """An LLMEngine served from one background thread to asyncio callers."""

    def __init__(
        self,
        engine: LLMEngine,
        *,
        max_waiting_requests: int | None = None,
        on_step: StepCallback | None = None,
        on_error: ErrorCallback | None = None,
    ) -> None:
        if max_waiting_requests is not None and (
            not isinstance(max_waiting_requests, int) or max_waiting_requests < 1
        ):
            raise ValueError(f"max_waiting_requests must be an integer >= 1, got {max_waiting_requests!r}")
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.on_step = on_step
        self.on_error = on_error
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _closed against a submit racing the thread's exit
        self._closed = False
        self.error: BaseException | None = None  # why the engine thread died, if it did
        # Engine-thread state: where each request's outputs go (this layer's one record of its ids).
        self._sinks: dict[str, _Sink] = {}
        self._thread = threading.Thread(target=self._run, name="pagoda-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, args: EngineArgs, **kwargs: Any) -> AsyncLLM:
        return cls(LLMEngine(args), **kwargs)

    # ---- read-only facts (safe from any thread) ---------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def weight_format(self) -> str:
        return self.engine.weight_format

    @property
    def is_running(self) -> bool:
        return not self._closed

    def chat_prompt(self, messages: list[dict], **template_kwargs: Any) -> list[int]:
        """Chat template → prompt token ids (tokenizer only; no engine state is touched)."""
        return self.engine.chat_prompt(messages, **template_kwargs)

    # ---- requests --------------------------------------------------------------------------------
    async def add_requests(
        self,
        request_ids: Sequence[str],
        prompts: Sequence[Prompt],
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
        stream: bool = True,
    ) -> RequestStream:
        """Queue requests that share sampling params; all are accepted or none. Raises ValueError
        naming a bad parameter or prompt, EngineOverloadedError when the waiting queue is full,
        EngineDeadError when the engine is not running."""
        if len(request_ids) != len(prompts) or not prompts:
            raise ValueError(f"got {len(request_ids)} request ids for {len(prompts)} prompts")
        grammar = None
        if isinstance(params, SamplingParams) and params.structured_outputs is not None:
            self.engine.args.limits.check_structured(params.structured_outputs)  # before compiling
            # Compiled off the engine loop (and off the event loop): other requests keep running.
            future = await asyncio.to_thread(self.engine.compile_grammar, params.structured_outputs)
            grammar = await asyncio.wrap_future(future)
        sink = _Sink()
        self._submit(_Add(list(request_ids), list(prompts), params, cache_salt, stream, sink, grammar))
        try:
            item = await sink.queue.get()
        except asyncio.CancelledError:
            self._submit(_Abort(list(request_ids)))  # queued after the add, so it undoes it
            raise
        if isinstance(item, BaseException):
            raise item
        return RequestStream(self, list(request_ids), sink)

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str | None = None,
        *,
        cache_salt: str | None = None,
        stream: bool = True,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request: deltas (stream=True) or one final output. Validation errors
        surface as ValueError before the first output; leaving the loop early aborts the request."""
        request_id = request_id or f"req-{uuid.uuid4().hex}"
        async with await self.add_requests(
            [request_id], [prompt], params, cache_salt=cache_salt, stream=stream
        ) as s:
            async for out in s:
                yield out

    def abort(self, request_ids: Sequence[str]) -> None:
        self._submit(_Abort(list(request_ids)))

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run `fn(engine)` on the engine thread between steps (the engine is not thread-safe)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise EngineDeadError(self._dead_message())
            self._commands.put(_Call(fn, future))
        return await asyncio.wrap_future(future)

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Abort whatever runs, stop the engine thread and wait for it (idempotent)."""
        with self._lock:
            if not self._closed:
                self._commands.put(_STOP)
        self._thread.join(timeout)

    def _submit(self, command: Any) -> None:
        with self._lock:
            if not self._closed:
                self._commands.put(command)
                return
        if isinstance(command, _Add):
            raise EngineDeadError(self._dead_message())

    def _dead_message(self) -> str:
        if self.error is None:
            return "the engine is shut down"
        return f"the engine stopped after an error: {self.error!r}"

    # ---- the engine thread -----------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                commands = [self._commands.get()] if not engine.has_unfinished_requests() else []
                with contextlib.suppress(queue.Empty):
                    while True:
                        commands.append(self._commands.get_nowait())
                for command in commands:
                    if command is _STOP:
                        self._stop()
                        return
                    if isinstance(command, _Add):
                        self._add(command)
                    elif isinstance(command, _Call):
                        try:
                            command.future.set_result(command.fn(engine))
                        except Exception as exc:
                            command.future.set_exception(exc)
                    else:
                        self._publish(engine.abort_request(command.request_ids))
                if engine.has_unfinished_requests():
                    self._publish(engine.step())
        except BaseException as exc:
            logger.exception("the engine thread died")
            self.error = exc
            self._stop()
            if self.on_error is not None:
                try:
                    self.on_error(exc)
                except Exception:
                    logger.exception("the engine's error callback failed")

    def _add(self, cmd: _Add) -> None:
        engine = self.engine
        waiting = engine.stats().num_waiting
        if self.max_waiting_requests is not None and waiting >= self.max_waiting_requests:
            cmd.sink.put(
                EngineOverloadedError(
                    f"the server is overloaded: {waiting} requests are already waiting "
                    f"(max_waiting_requests={self.max_waiting_requests}); retry later"
                )
            )
            return
        added: list[str] = []
        try:
            for rid, prompt in zip(cmd.request_ids, cmd.prompts, strict=True):
                if rid in self._sinks:
                    raise ValueError(f"request id {rid!r} is already in use")
                engine.add_request(
                    rid, prompt, cmd.params, cache_salt=cmd.cache_salt, stream=cmd.stream, grammar=cmd.grammar
                )
                added.append(rid)
        except ValueError as exc:
            engine.abort_request(added)
            cmd.sink.put(exc)
            return
        for rid in added:
            self._sinks[rid] = cmd.sink
        cmd.sink.put(_ACCEPTED)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        if self.on_step is not None:
            self.on_step(outputs, self.engine.last_step_stats)
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            if out.finished:
                del self._sinks[out.request_id]
            sink.put(out)

    def _stop(self) -> None:
        """Abort everything, tell every listener, refuse new commands. Runs on the engine thread.
        After a shutdown the streams end with finish_reason "abort"; after a failure they raise."""
        with self._lock:
            self._closed = True
        try:
            finals = self.engine.abort_request(list(self._sinks))  # frees their blocks
            if self.error is None:
                self._publish(finals)
        except Exception:
            logger.exception("aborting the remaining requests failed")
        dead = EngineDeadError(self._dead_message())
        for sink in self._sinks.values():
            sink.put(dead)
        self._sinks.clear()
        with contextlib.suppress(queue.Empty):
            while True:
                command = self._commands.get_nowait()
                if isinstance(command, _Add):
                    command.sink.put(dead)
                elif isinstance(command, _Call):
                    command.future.set_exception(dead)
