"""httpx clients for pagoda's own HTTP callers (the router's backend pool, `pagoda.lang`'s
RuntimeEndpoint, the benchmarks), safe under hundreds of concurrent requests on one client.

HTTP/1.1 keep-alive has two races that many concurrent requests over one pool run into:

1. The server closes an idle connection (uvicorn after its keep-alive timeout) just as the client
   sends the next request on it. The request fails with "Server disconnected without sending a
   response" or "Connection reset by peer" although the server never read it. Browsers and the
   OpenAI SDK send such a request again; so do these clients: `RetryTransport` resends a request
   that failed on a reused connection before any response came (`RETRIED`), up to `RETRIES`
   times. A request is only resent whole (its body is bytes in memory); a failure on a fresh
   connection or after the response headers is never resent.
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

RETRIES = 3  # resends of one request whose reused connection failed before the response
# Failures that happen before any byte of the response (httpx's transports return once the
# response headers are in): the connection was closed or reset under the request.
RETRIED = (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)


def limits(max_connections: int | None = None) -> httpx.Limits:
    """Pool limits without client-side expiry or a cap on idle connections (race 2 above)."""
    return httpx.Limits(
        max_connections=max_connections, max_keepalive_connections=None, keepalive_expiry=None
    )


class _Attempt:
    """One send, followed through httpcore's `trace` extension (installed for the `with` block):
    was the request last sent on a connection an earlier request had used (no TCP connect first)?"""

    def __init__(self, request: httpx.Request, asynchronous: bool = False) -> None:
        self._request = request
        self._outer = request.extensions.get("trace")  # a caller's own trace, still called
        self._hook = self._atrace if asynchronous else self._trace
        self._connected = False
        self.reused = False

    def __enter__(self) -> _Attempt:
        self._request.extensions = {**self._request.extensions, "trace": self._hook}
        return self

    def __exit__(self, *exc_info: object) -> None:
        extensions = {k: v for k, v in self._request.extensions.items() if k != "trace"}
        self._request.extensions = extensions if self._outer is None else {**extensions, "trace": self._outer}

    def _see(self, name: str) -> None:
        if name == "connection.connect_tcp.started":
            self._connected = True
        elif name == "http11.send_request_headers.started":
            self.reused, self._connected = not self._connected, False

    def _trace(self, name: str, info: dict[str, Any]) -> None:
        self._see(name)
        if self._outer is not None:
            self._outer(name, info)

    async def _atrace(self, name: str, info: dict[str, Any]) -> None:
        self._see(name)
        if self._outer is not None:
            await self._outer(name, info)


def _resend(request: httpx.Request, attempt: _Attempt, exc: httpx.TransportError, last: bool) -> bool:
    """Whether to send `request` again after `exc` (False on the `last` allowed send). Only a
    request that failed on a reused connection before any response (what browsers resend): a
    fresh connection closed under it means the server is failing, not racing."""
    if last or not attempt.reused or not isinstance(request.stream, httpx.ByteStream):
        return False  # a streamed upload cannot be sent twice
    if isinstance(exc, httpx.RemoteProtocolError) and not str(exc).startswith("Server disconnected"):
        return False  # other protocol errors are a bad response
    logger.debug("%s %s: resent after %r on a reused connection", request.method, request.url, exc)
    return True


class RetryTransport(httpx.BaseTransport):
    """A transport (`httpx.HTTPTransport`) that resends a request whose reused connection failed
    before the response, up to `retries` times."""

    def __init__(self, inner: httpx.BaseTransport, retries: int = RETRIES) -> None:
        self._inner = inner
        self._retries = retries

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        for resends in range(self._retries + 1):
            with _Attempt(request) as attempt:
                try:
                    return self._inner.handle_request(request)
                except RETRIED as exc:
                    if not _resend(request, attempt, exc, last=resends == self._retries):
                        raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        self._inner.close()


class AsyncRetryTransport(httpx.AsyncBaseTransport):
    """`RetryTransport` for `httpx.AsyncClient`."""

    def __init__(self, inner: httpx.AsyncBaseTransport, retries: int = RETRIES) -> None:
        self._inner = inner
        self._retries = retries

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        for resends in range(self._retries + 1):
            with _Attempt(request, asynchronous=True) as attempt:
                try:
                    return await self._inner.handle_async_request(request)
                except RETRIED as exc:
                    if not _resend(request, attempt, exc, last=resends == self._retries):
                        raise
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        await self._inner.aclose()


def client(*, max_connections: int | None = None, verify: bool | str = True, **kwargs: Any) -> httpx.Client:
    """An `httpx.Client` (keyword arguments as its own: base_url, headers, timeout, ...) with the
    pool limits and resends above."""
    transport = RetryTransport(httpx.HTTPTransport(verify=verify, limits=limits(max_connections)))
    return httpx.Client(transport=transport, trust_env=False, **kwargs)


def async_client(*, max_connections: int | None = None, **kwargs: Any) -> httpx.AsyncClient:
    """`client` for asyncio."""
    transport = AsyncRetryTransport(httpx.AsyncHTTPTransport(limits=limits(max_connections)))
    return httpx.AsyncClient(transport=transport, trust_env=False, **kwargs)
