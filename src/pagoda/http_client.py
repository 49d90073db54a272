"""httpx clients for pagoda's own HTTP callers (the router's backend pool, `pagoda.lang`'s
RuntimeEndpoint, the benchmarks), safe under hundreds of concurrent requests on one client.

HTTP/1.1 keep-alive has two races that many concurrent requests over one pool run into:

1. The server closes an idle connection (uvicorn after its keep-alive timeout) just as the client
   sends the next request on it. The request fails with "Server disconnected without sending a
   response" or "Connection reset by peer" although the server never read it. Browsers and the
   OpenAI SDK send such a request again; so do these clients: `RetryTransport` resends a request
   that failed before any response came (`RETRIED`), on another connection, up to `RETRIES` times.
   A request is only resent whole (its body is bytes in memory); an error after the response
   headers is never retried.
2. httpcore's pool (1.0.x) hands an idle connection to a waiting request, and until that request
   marks it busy, another thread's pass over the pool may close it: when it expires on the
   client's clock, or as a surplus keep-alive connection (encode/httpcore issue 1110). The socket
   is then closed under a request that waits for its response; on Linux that does not wake the
   read, so the request hangs until its read timeout (seen as threads stuck on response headers
   for the whole timeout, then "Bad file descriptor"). These clients therefore never expire
   pooled connections on their own clock and keep every idle one (`limits`): a pooled connection
   is dropped only once the server has closed it, which no waiting request can be hurt by (its
   read sees the close at once).

Requests through these clients connect directly (no proxy from the environment).
"""

from __future__ import annotations

import logging
from typing import Any

import httpx

logger = logging.getLogger("pagoda.http_client")

RETRIES = 3  # resends of one request whose connection failed before the response
# Failures that happen before any byte of the response (httpx's transports return once the
# response headers are in): the connection was closed or reset under the request.
RETRIED = (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)


def limits(max_connections: int | None = None) -> httpx.Limits:
    """Pool limits without client-side expiry or a cap on idle connections (race 2 above)."""
    return httpx.Limits(
        max_connections=max_connections, max_keepalive_connections=None, keepalive_expiry=None
    )


def _retryable(request: httpx.Request, exc: httpx.TransportError) -> bool:
    if not isinstance(request.stream, httpx.ByteStream):  # a streamed upload cannot be sent twice
        return False
    if isinstance(exc, httpx.RemoteProtocolError):  # other protocol errors are a bad response
        return str(exc).startswith("Server disconnected")
    return isinstance(exc, RETRIED)


class RetryTransport(httpx.BaseTransport):
    """An `httpx.HTTPTransport` that resends a request whose connection failed before the response."""

    def __init__(self, retries: int = RETRIES, **transport: Any) -> None:
        self._inner = httpx.HTTPTransport(**transport)
        self._retries = retries

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        for attempt in range(self._retries + 1):
            try:
                return self._inner.handle_request(request)
            except RETRIED as exc:
                if attempt == self._retries or not _retryable(request, exc):
                    raise
                logger.debug("%s %s: resent after %r", request.method, request.url, exc)
        raise AssertionError("unreachable")

    def close(self) -> None:
        self._inner.close()


class AsyncRetryTransport(httpx.AsyncBaseTransport):
    """`RetryTransport` for `httpx.AsyncClient`."""

    def __init__(self, retries: int = RETRIES, **transport: Any) -> None:
        self._inner = httpx.AsyncHTTPTransport(**transport)
        self._retries = retries

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        for attempt in range(self._retries + 1):
            try:
                return await self._inner.handle_async_request(request)
            except RETRIED as exc:
                if attempt == self._retries or not _retryable(request, exc):
                    raise
                logger.debug("%s %s: resent after %r", request.method, request.url, exc)
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        await self._inner.aclose()


def client(*, max_connections: int | None = None, verify: bool | str = True, **kwargs: Any) -> httpx.Client:
    """An `httpx.Client` (keyword arguments as its own: base_url, headers, timeout, ...) with the
    pool limits and resends above."""
    transport = RetryTransport(verify=verify, limits=limits(max_connections))
    return httpx.Client(transport=transport, trust_env=False, **kwargs)


def async_client(*, max_connections: int | None = None, **kwargs: Any) -> httpx.AsyncClient:
    """`client` for asyncio."""
    transport = AsyncRetryTransport(limits=limits(max_connections))
    return httpx.AsyncClient(transport=transport, trust_env=False, **kwargs)
