"""pagoda's HTTP clients (pagoda.http_client) under the keep-alive races of many concurrent requests:
a request the server closed its connection under before answering is resent, never lost or hung;
hundreds of threads over one client against a real uvicorn server that closes idle connections
quickly all get their answers."""

from __future__ import annotations

import asyncio
import collections
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from inproc_server import serve_in_thread
from pagoda import http_client

pytestmark = pytest.mark.timeout(120)

OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"


class RacyServer:
    """A raw HTTP/1.1 server that answers the first `answered` requests on each connection and
    closes the connection under the next one without answering it: what a keep-alive timeout that
    fires as the client reuses the connection looks like to the client. `after_headers`: close it
    after that request's response headers instead (a failure that must not be resent)."""

    def __init__(self, answered: int = 1, after_headers: bool = False) -> None:
        self.answered = answered
        self.after_headers = after_headers
        self.requests: collections.Counter[str] = collections.Counter()  # first request line -> count
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.base_url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._connection, args=(conn,), daemon=True).start()

    def _connection(self, conn: socket.socket) -> None:
        with conn:
            for index in range(self.answered + 1):
                request = self._read_request(conn)
                if request is None:
                    return
                self.requests[request] += 1
                if index < self.answered:
                    conn.sendall(OK)
                elif self.after_headers:
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nok")
            conn.shutdown(socket.SHUT_RDWR)

    @staticmethod
    def _read_request(conn: socket.socket) -> str | None:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                return None
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = next(
            (
                int(line.split(b":")[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length")
            ),
            0,
        )
        while len(body) < length:
            body += conn.recv(65536)
        return head.split(b"\r\n")[0].decode()

    def close(self) -> None:
        self._listener.close()


@pytest.fixture
def racy() -> Iterator[RacyServer]:
    server = RacyServer()
    yield server
    server.close()


def test_plain_httpx_loses_the_request(racy: RacyServer) -> None:
    """The race the clients guard against: a reused connection closed before the answer."""
    with httpx.Client(base_url=racy.base_url, timeout=10.0) as client:
        assert client.get("/a").text == "ok"
        with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
            client.post("/b", json={"x": 1})


def test_request_on_a_closed_keep_alive_connection_is_resent(racy: RacyServer) -> None:
    with http_client.client(base_url=racy.base_url, timeout=10.0) as client:
        assert client.get("/a").text == "ok"
        response = client.post("/b", json={"x": 1})  # sent on the pooled connection, then resent
        assert response.status_code == 200 and response.text == "ok"
    assert racy.requests["POST /b HTTP/1.1"] == 2


def test_async_request_on_a_closed_keep_alive_connection_is_resent(racy: RacyServer) -> None:
    async def run() -> str:
        async with http_client.async_client(base_url=racy.base_url, timeout=10.0) as client:
            assert (await client.get("/a")).text == "ok"
            return (await client.post("/b", content=b"body")).text

    assert asyncio.run(run()) == "ok"
    assert racy.requests["POST /b HTTP/1.1"] == 2


def test_streamed_upload_is_not_resent(racy: RacyServer) -> None:
    """A body that cannot be read twice is never resent: the error reaches the caller."""
    with http_client.client(base_url=racy.base_url, timeout=10.0) as client:
        assert client.get("/a").text == "ok"
        with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
            client.post("/b", content=iter([b"part one", b"part two"]))
    assert racy.requests["POST /b HTTP/1.1"] == 1


def test_failure_after_the_response_headers_is_not_resent() -> None:
    server = RacyServer(after_headers=True)
    try:
        with http_client.client(base_url=server.base_url, timeout=10.0) as client:
            assert client.get("/a").text == "ok"
            with pytest.raises(httpx.RemoteProtocolError):
                client.post("/b", json={})
        assert server.requests["POST /b HTTP/1.1"] == 1
    finally:
        server.close()


def test_a_fresh_connection_closed_unanswered_is_not_resent() -> None:
    """Only reused connections race with a keep-alive timeout: a server that closes a new
    connection under the request is failing, and the caller (the router: another backend) hears
    of it at once."""
    server = RacyServer(answered=0)
    try:
        with (
            http_client.client(base_url=server.base_url, timeout=10.0) as client,
            pytest.raises(httpx.RemoteProtocolError),
        ):
            client.get("/b")
        assert server.requests["GET /b HTTP/1.1"] == 1
    finally:
        server.close()


def test_resends_are_bounded_and_a_callers_trace_still_runs() -> None:
    sent: list[str] = []
    seen: list[str] = []

    def stale_connection(request: httpx.Request) -> httpx.Response:
        # What httpcore reports for a request sent on a pooled connection that the server closed.
        request.extensions["trace"]("http11.send_request_headers.started", {})
        sent.append(request.content.decode())
        raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)

    transport = http_client.RetryTransport(httpx.MockTransport(stale_connection))
    with httpx.Client(transport=transport) as client, pytest.raises(httpx.RemoteProtocolError):
        client.post(
            "http://test/x", content=b"body", extensions={"trace": lambda name, info: seen.append(name)}
        )
    assert sent == ["body"] * (1 + http_client.RETRIES)
    assert seen == ["http11.send_request_headers.started"] * (1 + http_client.RETRIES)


# ---- many concurrent requests against a real uvicorn server ------------------------------------------------
async def _app(scope, receive, send) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            await send({"type": message["type"] + ".complete"})
            if message["type"] == "lifespan.shutdown":
                return
    await receive()
    await asyncio.sleep(0.02)  # every request of a burst is in flight at once
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture(scope="module")
def quick_close_server() -> Iterator[str]:
    """uvicorn (as pagoda serves: httptools and uvloop where installed) closing idle connections
    after 0.3 s, so that bursts 0.3 s apart reuse connections just as the server closes them."""
    with serve_in_thread(_app, timeout_keep_alive=0.3, access_log=True) as url:
        yield url


def test_hundreds_of_threads_on_one_client_all_get_answers(quick_close_server: str) -> None:
    """bench lang's `requests start` shape: 256 threads over one client, bursts as far apart as the
    server's keep-alive. Every request is answered: none lost to a closed connection, none hung
    (a read timeout of 10 s turns a hang into an error)."""
    outcomes: collections.Counter[str] = collections.Counter()
    with http_client.client(base_url=quick_close_server, timeout=10.0) as client:

        def one(_: int) -> str:
            try:
                return client.post("/v1/completions", json={"prompt": "hi"}).text
            except httpx.HTTPError as exc:
                return f"{type(exc).__name__}: {exc}"

        with ThreadPoolExecutor(256) as pool:
            for _ in range(10):
                outcomes.update(pool.map(one, range(256)))
                time.sleep(0.3)
    assert outcomes == {"ok": 10 * 256}, outcomes
