"""Forwarding one OpenAI request to a backend: pick, send, retry once, pass the bytes through.

A request may be retried on another backend only while nothing has reached the client: a connection
error, a timeout, a 5xx answer, or a failure before the first body chunk. A streamed (SSE) answer is
committed to the client once its first chunk has arrived; from then on chunks are relayed as they
come, and a backend failure ends the stream with an OpenAI-shaped error event, never silently.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import anyio
import httpx
from fastapi import Request, Response
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pagoda.http_body import BodyError, parse_json_body
from pagoda.router.backends import Backend, BackendPool
from pagoda.router.errors import error_response, is_openai_error, sse_error_event
from pagoda.router.metrics import RouterMetrics
from pagoda.router.policies import Policy
from pagoda.router.prompt_text import request_text

logger = logging.getLogger("pagoda.router")

# Response headers that describe one hop, or that the router sets itself.
_HOP_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",
        "content-encoding",
        "date",
        "server",
        "x-request-id",
    }
)
_MAX_ATTEMPTS = 2  # the first try and one retry on another backend


@dataclass(frozen=True)
class _Failure:
    """An attempt that failed before anything reached the client."""

    status: int  # what the client gets if no retry succeeds
    message: str
    code: str
    body: bytes | None = None  # the backend's own OpenAI-shaped error, passed through if last

    def response(self, request_id: str) -> Response:
        headers = {"x-request-id": request_id}
        if self.body is not None:
            return Response(self.body, self.status, headers=headers, media_type="application/json")
        return error_response(self.status, self.message, self.code, headers=headers)


class _Attempt:
    """One request in flight on one backend; `finish` releases it exactly once."""

    def __init__(self, proxy: Proxy, backend: Backend, model: str, request_id: str, started: float) -> None:
        self.proxy = proxy
        self.backend = backend
        self.model = model
        self.request_id = request_id
        self.started = started
        self.response: httpx.Response | None = None
        self._finished = False
        backend.in_flight += 1
        proxy.metrics.in_flight.labels(backend.url).inc()

    async def finish(self, outcome: str) -> None:
        if self._finished:
            return
        self._finished = True
        backend, metrics = self.backend, self.proxy.metrics
        backend.in_flight -= 1
        metrics.in_flight.labels(backend.url).dec()
        metrics.requests.labels(backend.url, outcome).inc()
        if self.response is not None:
            with anyio.CancelScope(shield=True):
                await self.response.aclose()
        logger.info(
            "request %s model=%s backend=%s outcome=%s %.1fms",
            self.request_id,
            self.model,
            backend.url,
            outcome,
            (time.perf_counter() - self.started) * 1e3,
        )


class _RelayResponse(StreamingResponse):
    """Streams a backend's SSE body to the client chunk by chunk; releases the backend when done."""

    def __init__(
        self,
        attempt: _Attempt,
        first_chunk: bytes,
        chunks: AsyncIterator[bytes],
        status_code: int,
        headers: dict[str, str],
        endpoint: str,
    ) -> None:
        self._attempt = attempt
        self._first_chunk = first_chunk
        self._chunks = chunks
        self._endpoint = endpoint
        self._outcome = "client_closed"  # until the relay ends on its own
        super().__init__(self._relay(), status_code=status_code, headers=headers)

    async def _relay(self) -> AsyncIterator[bytes]:
        if self._first_chunk:
            yield self._first_chunk
        try:
            async for chunk in self._chunks:
                yield chunk
        except httpx.HTTPError as exc:
            backend = self._attempt.backend
            reason = f"stream broke: {type(exc).__name__}: {exc}"
            self._attempt.proxy.pool.mark_unhealthy(backend, reason)
            self._outcome = "stream_error"
            logger.warning("request %s: backend %s %s", self._attempt.request_id, backend.url, reason)
            yield sse_error_event(
                f"the backend serving this request failed mid-stream ({type(exc).__name__})",
                "backend_stream_error",
            )
            return
        self._outcome = str(self.status_code)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            attempt = self._attempt
            attempt.proxy.metrics.latency.labels(self._endpoint).observe(
                time.perf_counter() - attempt.started
            )
            await attempt.finish(self._outcome)


class Proxy:
    def __init__(
        self,
        pool: BackendPool,
        policy: Policy,
        metrics: RouterMetrics,
        router_api_key: str | None,
    ) -> None:
        self.pool = pool
        self.policy = policy
        self.metrics = metrics
        self.router_api_key = router_api_key
        self.client: httpx.AsyncClient | None = None  # set by the app's lifespan

    async def forward(self, request: Request, endpoint: str, request_id: str) -> Response:
        """Route one POST to `request.url.path` on a backend; `endpoint` is "chat" or "completion"."""
        started = time.perf_counter()
        headers = {"x-request-id": request_id}
        body = await request.body()  # at most max_body_size bytes: the app answers 413 beyond
        try:
            payload = parse_json_body(body)  # invalid UTF-8, lone surrogates, NaN: 400 naming the field
        except BodyError as exc:
            return error_response(400, str(exc), "invalid_json", headers, exc.param)
        if not isinstance(payload, dict):
            return error_response(400, "the request body must be a JSON object", "invalid_json", headers)
        known = self.pool.known_models()
        model = payload.get("model")
        if model is None and len(known) == 1:
            model = next(iter(known))
        if not isinstance(model, str) or not model:
            return error_response(
                400, "'model' must be a non-empty string", "invalid_model", headers, "model"
            )
        if model not in known:
            return error_response(
                404,
                f"The model `{model}` does not exist. Available: {sorted(known)}",
                "model_not_found",
                headers,
                "model",
            )
        text = request_text(endpoint, payload) if self.policy.uses_text else ""

        tried: list[Backend] = []
        failure: _Failure | None = None
        for _ in range(_MAX_ATTEMPTS):
            candidates = [b for b in self.pool.candidates(model) if b not in tried]
            if not candidates:
                break
            if tried:
                self.metrics.retries.labels(tried[-1].url).inc()
                logger.warning("request %s: retrying after %s (%s)", request_id, tried[-1].url, failure)
            decision = self.policy.choose(model, text, candidates)
            self.metrics.decisions.labels(self.policy.name, decision.reason).inc()
            backend = self.pool.backend(decision.backend.url)
            tried.append(backend)
            result = await self._attempt(backend, request, body, model, request_id, started, endpoint)
            if isinstance(result, Response):
                return result
            failure = result
        if failure is None:
            return error_response(
                503, f"no healthy backend serves the model `{model}` right now", "no_healthy_backend", headers
            )
        self.metrics.latency.labels(endpoint).observe(time.perf_counter() - started)
        return failure.response(request_id)

    def _backend_headers(self, request: Request, backend: Backend, request_id: str) -> dict[str, str]:
        headers = {
            "content-type": request.headers.get("content-type", "application/json"),
            "accept": request.headers.get("accept", "*/*"),
            "accept-encoding": "identity",
            "x-request-id": request_id,
        }
        if backend.config.api_key:
            headers["authorization"] = f"Bearer {backend.config.api_key}"
        elif self.router_api_key is None and "authorization" in request.headers:
            headers["authorization"] = request.headers["authorization"]  # a transparent router
        return headers

    async def _attempt(
        self,
        backend: Backend,
        request: Request,
        body: bytes,
        model: str,
        request_id: str,
        started: float,
        endpoint: str,
    ) -> Response | _Failure:
        if self.client is None:
            raise RuntimeError("the router's HTTP client is not started (is the app's lifespan running?)")
        attempt = _Attempt(self, backend, model, request_id, started)
        outcome = "cancelled"
        handed_over = False  # once a _RelayResponse owns the attempt, it finishes it
        try:
            backend_request = self.client.build_request(
                "POST",
                backend.url + request.url.path,
                content=body,
                headers=self._backend_headers(request, backend, request_id),
            )
            try:
                attempt.response = response = await self.client.send(backend_request, stream=True)
            except httpx.HTTPError as exc:
                outcome = "timeout" if isinstance(exc, httpx.TimeoutException) else "connect_error"
                return self._transport_failure(backend, exc)
            outcome = str(response.status_code)
            is_stream = response.headers.get("content-type", "").startswith("text/event-stream")
            if response.is_success and is_stream:
                chunks = response.aiter_raw()
                try:
                    first_chunk = await anext(chunks, b"")
                except httpx.HTTPError as exc:
                    outcome = "timeout" if isinstance(exc, httpx.TimeoutException) else "stream_error"
                    return self._transport_failure(backend, exc)
                relay = _RelayResponse(
                    attempt,
                    first_chunk,
                    chunks,
                    response.status_code,
                    self._client_headers(response, request_id),
                    endpoint,
                )
                handed_over = True
                return relay
            try:
                data = await response.aread()
            except httpx.HTTPError as exc:
                outcome = "timeout" if isinstance(exc, httpx.TimeoutException) else "stream_error"
                return self._transport_failure(backend, exc)
            if response.status_code >= 500:
                passthrough = is_openai_error(data)
                return _Failure(
                    response.status_code if passthrough else 502,
                    f"backend answered {response.status_code}: {data[:300].decode(errors='replace')}",
                    "backend_error",
                    body=data if passthrough else None,
                )
            self.metrics.latency.labels(endpoint).observe(time.perf_counter() - started)
            if response.status_code >= 400 and not is_openai_error(data):
                return error_response(
                    response.status_code,
                    f"backend answered {response.status_code}: {data[:300].decode(errors='replace')}",
                    "backend_error",
                    {"x-request-id": request_id},
                )
            return Response(data, response.status_code, headers=self._client_headers(response, request_id))
        finally:
            if not handed_over:
                await attempt.finish(outcome)

    def _transport_failure(self, backend: Backend, exc: httpx.HTTPError) -> _Failure:
        """The backend did not answer properly: take it out of rotation until a health check passes."""
        reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        self.pool.mark_unhealthy(backend, reason)
        if isinstance(exc, httpx.TimeoutException):
            return _Failure(504, f"backend request timed out ({reason})", "backend_timeout")
        return _Failure(502, f"backend request failed ({reason})", "backend_unavailable")

    @staticmethod
    def _client_headers(response: httpx.Response, request_id: str) -> dict[str, str]:
        headers = {k: v for k, v in response.headers.items() if k.lower() not in _HOP_HEADERS}
        headers["x-request-id"] = request_id
        return headers
