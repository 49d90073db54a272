"""End-to-end tests of `pagoda router` and `pagoda launch` against fake and real backends.

The fakes are small OpenAI-compatible FastAPI apps on free loopback ports (in threads, or in a
subprocess when a test must kill one): they stream deterministic SSE, fail with 500, hang, die
before or in the middle of a stream, or drop the connection. Every wait is bounded.

Run as a script (`python tests/test_router.py --serve-fake MODEL --port P`) this file serves one fake
backend: the failover and launch tests start it that way so that they can kill it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

SRC = str(Path(__file__).resolve().parents[1] / "src")
if SRC not in sys.path:  # when run as a script
    sys.path.insert(0, SRC)

from pagoda.router.app import create_app  # noqa: E402
from pagoda.router.config import BackendConfig, RouterConfig  # noqa: E402
from pagoda.router.launch import launch_replicas  # noqa: E402
from pagoda.router.policies import POLICIES, CacheAwareConfig  # noqa: E402

pytestmark = pytest.mark.timeout(90)

LOOPBACK = "127.0.0.1"
CLIENT_TIMEOUT = httpx.Timeout(20.0)


# ---------------------------------------------------------------- fake backends


@dataclass
class FakeControl:
    """How a fake backend behaves; tests flip these fields while it runs."""

    mode: str = "ok"  # ok | fail500 | fail503_openai | hang | die_before_first_chunk | die_midstream | gated
    health_ok: bool = True
    chunks: int = 4
    chunk_delay_s: float = 0.0
    # "gated": chunk i > 0 is sent only once `acked >= i` (the client confirms what it has) or `gate` is set.
    acked: int = 0
    gate: threading.Event = field(default_factory=threading.Event)
    requests: list[dict[str, Any]] = field(default_factory=list)


def sse_chunks(name: str, model: str, kind: str, n: int) -> list[bytes]:
    """The exact bytes a fake streams (deterministic, so router and direct streams can be compared)."""
    out = []
    for i in range(n):
        last = i == n - 1
        if kind == "chat":
            chunk = {
                "id": "chatcmpl-fake",
                "object": "chat.completion.chunk",
                "created": 0,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "delta": {"content": f"{name}-{i} "},
                        "finish_reason": "length" if last else None,
                    }
                ],
            }
        else:
            chunk = {
                "id": "cmpl-fake",
                "object": "text_completion",
                "created": 0,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "text": f"{name}-{i} ",
                        "logprobs": None,
                        "finish_reason": "length" if last else None,
                    }
                ],
            }
        out.append(f"data: {json.dumps(chunk)}\n\n".encode())
    out.append(b"data: [DONE]\n\n")
    return out


def make_fake_app(name: str, models: list[str], control: FakeControl) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if control.health_ok else 503)

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        cards = [
            {"id": m, "object": "model", "created": 0, "owned_by": name, "max_model_len": 2048}
            for m in models
        ]
        return {"object": "list", "data": cards}

    async def stream(model: str, kind: str) -> AsyncIterator[bytes]:
        chunks = sse_chunks(name, model, kind, control.chunks)
        if control.mode == "die_before_first_chunk":
            raise RuntimeError("fake backend dies before its first chunk")
        for i, chunk in enumerate(chunks):
            if i and control.mode == "gated":
                deadline = time.monotonic() + 20
                while control.acked < i and not control.gate.is_set() and time.monotonic() < deadline:
                    await asyncio.sleep(0.005)
            if i == 2 and control.mode == "die_midstream":
                raise RuntimeError("fake backend dies mid-stream")
            if i and control.chunk_delay_s:
                await asyncio.sleep(control.chunk_delay_s)
            yield chunk

    async def handle(request: Request, kind: str) -> Response:
        payload = await request.json()
        control.requests.append({"path": request.url.path, "headers": dict(request.headers), "json": payload})
        model = payload.get("model", models[0])
        if control.mode == "fail500":
            return PlainTextResponse("boom", status_code=500)
        if control.mode == "fail503_openai":
            error = {
                "message": f"{name} is overloaded",
                "type": "server_error",
                "param": None,
                "code": "overloaded",
            }
            return JSONResponse({"error": error}, status_code=503)
        if control.mode == "hang":
            await asyncio.sleep(30)
        if payload.get("stream"):
            return StreamingResponse(stream(model, kind), media_type="text/event-stream")
        text = f"{name}-answer"
        choice = (
            {"index": 0, "message": {"role": "assistant", "content": text}}
            if kind == "chat"
            else {"index": 0, "text": text}
        )
        return JSONResponse(
            {"id": "fake", "object": kind, "model": model, "choices": [{**choice, "finish_reason": "stop"}]}
        )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await handle(request, "chat")

    return app


def tcp_listen_socket(port: int) -> socket.socket:
    # proto=IPPROTO_TCP matters: asyncio enables TCP_NODELAY on accepted sockets only when the listening
    # socket says it is TCP; with proto 0, Nagle + delayed ACK add ~40 ms to every response.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((LOOPBACK, port))
    return sock


class ServerThread:
    """A uvicorn server on a free loopback port, in a thread with its own event loop."""

    def __init__(self, app: Any) -> None:
        self.sock = tcp_listen_socket(0)
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="critical", access_log=False))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def start(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 15
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("test server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.request_stop()
        self.join()

    def request_stop(self) -> None:
        self.server.should_exit = True
        self.server.force_exit = True

    def join(self) -> None:
        self.thread.join(timeout=15)
        self.sock.close()


def stop_all(servers: list[ServerThread]) -> None:
    for server in servers:
        server.request_stop()
    for server in servers:
        server.join()


class Fake:
    def __init__(self, name: str, models: list[str]) -> None:
        self.name = name
        self.models = models
        self.control = FakeControl()
        self.server = ServerThread(make_fake_app(name, models, self.control)).start()
        self.url = self.server.url


class ClosingServer:
    """Answers GET /health with 200 and drops every other request without a response."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind((LOOPBACK, 0))
        self.sock.listen(16)
        self.sock.settimeout(0.1)
        self.url = f"http://{LOOPBACK}:{self.sock.getsockname()[1]}"
        self.dropped = 0
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(2)
                data = b""
                with contextlib.suppress(OSError):
                    while b"\r\n\r\n" not in data and len(data) < 65536:
                        piece = conn.recv(4096)
                        if not piece:
                            break
                        data += piece
                if data.startswith(b"GET /health"):
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")
                else:
                    self.dropped += 1

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=5)
        self.sock.close()


@pytest.fixture
def fakes() -> Iterator[Any]:
    started: list[Any] = []

    def make(name: str, models: list[str] | None = None) -> Fake:
        fake = Fake(name, models or ["m1"])
        started.append(fake.server)
        return fake

    yield make
    stop_all(started)


@pytest.fixture
def router() -> Iterator[Any]:
    """router(backends, **config) -> base URL of a router app running in a thread."""
    started: list[ServerThread] = []

    def make(backends: list[BackendConfig], **kwargs: Any) -> str:
        kwargs.setdefault("health_interval_s", 60.0)
        kwargs.setdefault("read_timeout_s", 10.0)
        app = create_app(RouterConfig(backends=tuple(backends), **kwargs))
        server = ServerThread(app).start()
        started.append(server)
        server.app = app  # type: ignore[attr-defined]
        return server.url

    make.servers = started  # type: ignore[attr-defined]
    yield make
    stop_all(started)


def state_of(router_fixture: Any) -> Any:
    return router_fixture.servers[-1].app.state.router


def backend(fake: Fake | ClosingServer, *models: str, **kwargs: Any) -> BackendConfig:
    return BackendConfig(fake.url, tuple(models), **kwargs)


def complete(base: str, model: str = "m1", prompt: str = "hi", **kwargs: Any) -> httpx.Response:
    headers = kwargs.pop("headers", {})
    body = {"model": model, "prompt": prompt, "max_tokens": 4, **kwargs}
    with httpx.Client(timeout=CLIENT_TIMEOUT, trust_env=False) as client:
        return client.post(f"{base}/v1/completions", json=body, headers=headers)


def stream_raw(base: str, path: str, body: dict[str, Any]) -> tuple[int, list[bytes]]:
    with (
        httpx.Client(timeout=CLIENT_TIMEOUT, trust_env=False) as client,
        client.stream("POST", f"{base}{path}", json=body) as response,
    ):
        return response.status_code, list(response.iter_raw())


def served_by(response: httpx.Response) -> str:
    return response.json()["choices"][0]["text"].split("-")[0]


def assert_openai_error(response: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert {"type", "param", "code"} <= set(error)
    if code is not None:
        assert error["code"] == code
    return error


def wait_until(predicate: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.02)


# ---------------------------------------------------------------- routing


def test_routes_by_model_and_lists_the_union_of_models(fakes: Any, router: Any) -> None:
    a, b, c = fakes("A"), fakes("B", ["m2"]), fakes("C", ["m1", "m3"])
    base = router([backend(a, "m1"), backend(b, "m2"), backend(c)], policy="round-robin")  # c: discovered
    assert {served_by(complete(base, "m2")) for _ in range(4)} == {"B"}
    assert {served_by(complete(base, "m1")) for _ in range(4)} == {"A", "C"}
    assert {served_by(complete(base, "m3")) for _ in range(2)} == {"C"}
    assert_openai_error(complete(base, "nope"), 404, "model_not_found")

    with httpx.Client(timeout=CLIENT_TIMEOUT, trust_env=False) as client:
        models = client.get(f"{base}/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == ["m1", "m2", "m3"]
    assert next(m for m in models["data"] if m["id"] == "m3")["owned_by"] == "C"  # discovered card kept


def test_bad_requests_get_openai_errors(fakes: Any, router: Any) -> None:
    a, b = fakes("A"), fakes("B", ["m2"])
    base = router([backend(a, "m1"), backend(b, "m2")])
    with httpx.Client(timeout=CLIENT_TIMEOUT, trust_env=False) as client:
        assert_openai_error(client.post(f"{base}/v1/completions", content=b"{not json"), 400, "invalid_json")
        assert_openai_error(client.post(f"{base}/v1/completions", json=[1]), 400, "invalid_json")
        assert_openai_error(client.post(f"{base}/v1/completions", json={"prompt": "x"}), 400, "invalid_model")
        assert_openai_error(client.get(f"{base}/v1/nothing"), 404, "not_found")
    single = router([backend(a, "m1")])
    with httpx.Client(timeout=CLIENT_TIMEOUT, trust_env=False) as client:  # one model: "model" may be omitted
        assert client.post(f"{single}/v1/completions", json={"prompt": "x"}).status_code == 200


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_routes_within_the_model(fakes: Any, router: Any, policy: str) -> None:
    a, b, other = fakes("A"), fakes("B"), fakes("O", ["m2"])
    base = router([backend(a, "m1"), backend(b, "m1"), backend(other, "m2")], policy=policy, seed=3)
    served = [served_by(complete(base, prompt=f"{i}: a distinct prompt")) for i in range(8)]
    assert set(served) == {"A", "B"}
    if policy == "round-robin":
        assert served == ["A", "B"] * 4
    if policy == "cache-aware":
        repeat = [served_by(complete(base, prompt="5: a distinct prompt, continued")) for _ in range(3)]
        assert repeat == [served[5]] * 3
    assert len(other.control.requests) == 0


def test_cache_aware_spreads_concurrent_load(fakes: Any, router: Any) -> None:
    """With every request sharing one prefix, the balance rule must still send some to the idle backend."""
    a, b = fakes("A"), fakes("B")
    a.control.mode = b.control.mode = "gated"
    cache = CacheAwareConfig(balance_abs_threshold=2, balance_rel_threshold=1.5)
    base = router([backend(a, "m1"), backend(b, "m1")], cache_aware=cache)

    async def run() -> list[int]:
        async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT, trust_env=False) as client:

            async def one(i: int) -> int:
                body = {"model": "m1", "prompt": f"the same shared system prompt {i}", "stream": True}
                async with client.stream("POST", f"{base}/v1/completions", json=body) as response:
                    async for _ in response.aiter_raw():
                        pass
                    return response.status_code

            tasks = []
            for i in range(10):  # one at a time, so that each sees the in-flight count of the previous ones
                tasks.append(asyncio.create_task(one(i)))
                await asyncio.wait_for(
                    _until(lambda n=i + 1: len(a.control.requests) + len(b.control.requests) >= n), 10
                )
            a.control.gate.set()
            b.control.gate.set()
            return await asyncio.wait_for(asyncio.gather(*tasks), 30)

    assert asyncio.run(run()) == [200] * 10
    assert len(a.control.requests) >= 3 and len(b.control.requests) >= 3


async def _until(predicate: Any) -> None:
    while not predicate():
        await asyncio.sleep(0.005)


# ---------------------------------------------------------------- streaming


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"model": "m1", "prompt": "hi", "stream": True}),
        (
            "/v1/chat/completions",
            {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "stream": True},
        ),
    ],
)
def test_streaming_through_the_router_equals_streaming_direct(
    fakes: Any, router: Any, path: str, body: dict[str, Any]
) -> None:
    a = fakes("A")
    a.control.chunks = 6
    base = router([backend(a, "m1")])
    direct_status, direct = stream_raw(a.url, path, body)
    routed_status, routed = stream_raw(base, path, body)
    assert direct_status == routed_status == 200
    assert b"".join(routed) == b"".join(direct)
    assert b"".join(direct) == b"".join(sse_chunks("A", "m1", "chat" if "chat" in path else "completion", 6))


def test_streaming_is_passed_through_without_buffering(fakes: Any, router: Any) -> None:
    """The backend sends chunk i only after the client got chunk i-1: a buffering router would time out."""
    a = fakes("A")
    a.control.mode = "gated"
    a.control.chunks = 5
    base = router([backend(a, "m1")])
    body = {"model": "m1", "prompt": "hi", "stream": True}
    expected = sse_chunks("A", "m1", "completion", a.control.chunks)
    received = b""
    with (
        httpx.Client(timeout=httpx.Timeout(5.0), trust_env=False) as client,
        client.stream("POST", f"{base}/v1/completions", json=body) as response,
    ):
        assert response.headers["content-type"].startswith("text/event-stream")
        for chunk in response.iter_raw():
            received += chunk
            while received.startswith(b"".join(expected[: a.control.acked + 1])):
                a.control.acked += 1  # the backend may now send the next chunk
                if a.control.acked == len(expected):
                    break
    assert received == b"".join(expected)
    assert a.control.acked == len(expected) and not a.control.gate.is_set()


def test_a_client_leaving_mid_stream_releases_the_backend(fakes: Any, router: Any) -> None:
    a = fakes("A")
    a.control.mode = "gated"  # never acknowledged: the backend would hold chunk 2 for 20 s
    base = router([backend(a, "m1")])
    body = {"model": "m1", "prompt": "hi", "stream": True}
    with (
        httpx.Client(timeout=CLIENT_TIMEOUT, trust_env=False) as client,
        client.stream("POST", f"{base}/v1/completions", json=body) as response,
    ):
        assert next(response.iter_raw()).startswith(b"data: ")
    in_flight = lambda: httpx.get(f"{base}/health", timeout=CLIENT_TIMEOUT).json()["backends"][0]["in_flight"]  # noqa: E731
    wait_until(lambda: in_flight() == 0, 10)
    metrics = httpx.get(f"{base}/metrics", timeout=CLIENT_TIMEOUT).text
    assert f'pagoda_router_requests_total{{backend="{a.url}",status="client_closed"}} 1.0' in metrics


def test_openai_client_works_through_the_router(fakes: Any, router: Any) -> None:
    openai = pytest.importorskip("openai")
    a = fakes("A")
    base = router([backend(a, "m1")], api_key="router-key")
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="router-key", timeout=20, max_retries=0)
    assert [m.id for m in client.models.list().data] == ["m1"]
    chat = client.chat.completions.create(model="m1", messages=[{"role": "user", "content": "hi"}])
    assert chat.choices[0].message.content == "A-answer"
    pieces = [c.choices[0].text for c in client.completions.create(model="m1", prompt="hi", stream=True)]
    assert "".join(pieces) == "A-0 A-1 A-2 A-3 "
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi")
    bad = openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", timeout=20, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


# ---------------------------------------------------------------- failures and retries


def test_a_500_is_retried_once_on_another_backend(fakes: Any, router: Any) -> None:
    a, b = fakes("A"), fakes("B")
    a.control.mode = "fail500"
    base = router([backend(a, "m1"), backend(b, "m1")], policy="round-robin")
    assert [served_by(complete(base)) for _ in range(4)] == ["B"] * 4
    assert len(a.control.requests) == 2  # round-robin sent every other first attempt to A
    assert all(s.healthy for s in state_of(router).pool.backends)  # an HTTP 500 does not take A out

    b.control.mode = "fail500"
    before = len(a.control.requests) + len(b.control.requests)
    error = assert_openai_error(complete(base), 502, "backend_error")
    assert "boom" in error["message"]
    assert len(a.control.requests) + len(b.control.requests) == before + 2  # one retry, not more

    a.control.mode = b.control.mode = "fail503_openai"
    response = complete(base)
    assert_openai_error(response, 503, "overloaded")  # the backend's own OpenAI error passes through
    metrics = httpx.get(f"{base}/metrics", timeout=CLIENT_TIMEOUT).text
    retries = rf'pagoda_router_retries_total\{{backend="{re.escape(a.url)}"\}} [1-9]'
    assert re.search(retries, metrics)
    assert f'pagoda_router_requests_total{{backend="{a.url}",status="500"}} 3.0' in metrics


def test_a_dropped_connection_is_retried_and_the_backend_taken_out(fakes: Any, router: Any) -> None:
    closer, b = ClosingServer(), fakes("B")
    try:
        base = router([backend(closer, "m1"), backend(b, "m1")], policy="round-robin")
        assert [served_by(complete(base)) for _ in range(3)] == ["B"] * 3
        assert closer.dropped == 1  # then it was out of rotation
        state = state_of(router)
        assert not state.pool.backends[0].healthy and state.pool.backends[1].healthy
    finally:
        closer.stop()


@pytest.mark.parametrize("mode", ["die_before_first_chunk", "hang"])
def test_a_stream_failing_before_its_first_byte_is_retried(fakes: Any, router: Any, mode: str) -> None:
    a, b = fakes("A"), fakes("B")
    a.control.mode = mode
    base = router([backend(a, "m1"), backend(b, "m1")], policy="round-robin", read_timeout_s=1.0)
    status, chunks = stream_raw(base, "/v1/completions", {"model": "m1", "prompt": "hi", "stream": True})
    assert status == 200
    assert b"".join(chunks) == b"".join(sse_chunks("B", "m1", "completion", 4))
    assert len(a.control.requests) == 1


def test_hanging_backends_end_in_a_timeout_error_not_a_hang(fakes: Any, router: Any) -> None:
    a, b = fakes("A"), fakes("B")
    a.control.mode = b.control.mode = "hang"
    base = router([backend(a, "m1"), backend(b, "m1")], read_timeout_s=0.5)
    assert_openai_error(complete(base), 504, "backend_timeout")
    assert_openai_error(complete(base), 503, "no_healthy_backend")  # both were taken out


def test_a_stream_breaking_midway_ends_with_an_error_event(fakes: Any, router: Any) -> None:
    a = fakes("A")
    a.control.mode = "die_midstream"
    base = router([backend(a, "m1")])
    status, chunks = stream_raw(base, "/v1/completions", {"model": "m1", "prompt": "hi", "stream": True})
    body = b"".join(chunks)
    assert status == 200
    assert body.startswith(b"".join(sse_chunks("A", "m1", "completion", 4)[:2]))
    assert b"[DONE]" not in body
    last_event = json.loads(body.strip().split(b"\n\n")[-1].removeprefix(b"data: "))
    assert last_event["error"]["code"] == "backend_stream_error"


def test_health_checks_take_a_backend_out_and_put_it_back(fakes: Any, router: Any) -> None:
    a, b = fakes("A"), fakes("B")
    base = router([backend(a, "m1"), backend(b)], policy="round-robin", health_interval_s=0.1)
    health = lambda: httpx.get(f"{base}/health", timeout=CLIENT_TIMEOUT).json()  # noqa: E731
    assert [x["healthy"] for x in health()["backends"]] == [True, True]
    assert health()["backends"][1]["models"] == ["m1"]  # discovered

    a.control.health_ok = False
    wait_until(lambda: health()["backends"][0]["healthy"] is False)
    assert {served_by(complete(base)) for _ in range(4)} == {"B"}
    metrics = httpx.get(f"{base}/metrics", timeout=CLIENT_TIMEOUT).text
    assert f'pagoda_router_backend_healthy{{backend="{a.url}"}} 0.0' in metrics
    assert f'pagoda_router_failovers_total{{backend="{a.url}"}} 1.0' in metrics

    b.control.health_ok = False
    wait_until(lambda: health()["status"] == "unavailable")
    assert httpx.get(f"{base}/health", timeout=CLIENT_TIMEOUT).status_code == 503
    assert_openai_error(complete(base), 503, "no_healthy_backend")
    assert httpx.get(f"{base}/v1/models", timeout=CLIENT_TIMEOUT).json()["data"] == []

    a.control.health_ok = b.control.health_ok = True
    wait_until(lambda: health()["status"] == "ok" and all(x["healthy"] for x in health()["backends"]))
    assert {served_by(complete(base)) for _ in range(4)} == {"A", "B"}


def test_failover_when_a_backend_is_killed_mid_run(fakes: Any, router: Any, tmp_path: Path) -> None:
    """Concurrent streams on two backends; one is SIGKILLed: every stream completes or reports an error."""
    b = fakes("B")
    b.control.chunks, b.control.chunk_delay_s = 40, 0.05
    with fake_subprocess("P", "m1", chunks=40, chunk_delay_s=0.05) as p:
        base = router([BackendConfig(p.url, ("m1",)), backend(b, "m1")], policy="least-load")
        outcomes = asyncio.run(_streams_with_kill(base, p.pid, n=8))
    by_backend: dict[str, list[str]] = {"P": [], "B": []}
    for who, outcome in outcomes:
        by_backend[who].append(outcome)
    assert by_backend["B"] and set(by_backend["B"]) == {"done"}
    assert by_backend["P"] and set(by_backend["P"]) == {"error_event"}
    # Afterwards every request is served: P is out of rotation (or refused and retried on B).
    assert {served_by(complete(base, prompt=f"after {i}")) for i in range(4)} == {"B"}


async def _streams_with_kill(base: str, pid: int, n: int) -> list[tuple[str, str]]:
    first_chunk_seen = [asyncio.Event() for _ in range(n)]

    async def one(client: httpx.AsyncClient, i: int) -> tuple[str, str]:
        body = {"model": "m1", "prompt": f"request {i}", "stream": True, "max_tokens": 20}
        text = b""
        async with client.stream("POST", f"{base}/v1/completions", json=body) as response:
            if response.status_code != 200:
                return "?", f"status {response.status_code}"
            async for chunk in response.aiter_raw():
                text += chunk
                first_chunk_seen[i].set()
        who = json.loads(text.split(b"\n\n")[0].removeprefix(b"data: "))["choices"][0]["text"][0]
        if text.endswith(b"data: [DONE]\n\n"):
            return who, "done"
        last = json.loads(text.strip().split(b"\n\n")[-1].removeprefix(b"data: "))
        return who, "error_event" if "error" in last else "truncated silently"

    async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT, trust_env=False) as client:
        tasks = [asyncio.create_task(one(client, i)) for i in range(n)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in first_chunk_seen)), 15)
        os.kill(pid, signal.SIGKILL)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 30)
    return list(results)


@dataclass(frozen=True)
class FakeProcess:
    url: str
    pid: int


@contextlib.contextmanager
def fake_subprocess(
    name: str, model: str, chunks: int = 4, chunk_delay_s: float = 0.0
) -> Iterator[FakeProcess]:
    """A fake backend in its own process (so that it can be killed)."""
    argv = [sys.executable, __file__, "--serve-fake", model, "--name", name, "--port", "0"]
    argv += ["--chunks", str(chunks), "--chunk-delay", str(chunk_delay_s)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = _readline_with_timeout(proc, 30)
        match = re.fullmatch(r"PORT (\d+)\n", line)
        assert match, f"fake backend did not start: {line!r}"
        yield FakeProcess(f"http://{LOOPBACK}:{match.group(1)}", proc.pid)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        if proc.stdout:
            proc.stdout.close()


def _readline_with_timeout(proc: subprocess.Popen[str], timeout_s: float) -> str:
    result: list[str] = []
    reader = threading.Thread(target=lambda: result.append(proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
    reader.start()
    reader.join(timeout_s)
    return result[0] if result else ""


# ---------------------------------------------------------------- auth, request ids, metrics


def test_router_api_key(fakes: Any, router: Any) -> None:
    a = fakes("A")
    base = router([backend(a, "m1", api_key="backend-key")], api_key="router-key")
    error = assert_openai_error(complete(base), 401, "invalid_api_key")
    assert error["type"] == "invalid_request_error"
    assert_openai_error(complete(base, headers={"authorization": "Bearer wrong"}), 401, "invalid_api_key")
    assert httpx.get(f"{base}/v1/models", timeout=CLIENT_TIMEOUT).status_code == 401
    assert complete(base, headers={"authorization": "Bearer router-key"}).status_code == 200
    assert (
        a.control.requests[-1]["headers"]["authorization"] == "Bearer backend-key"
    )  # never the router's key
    assert httpx.get(f"{base}/health", timeout=CLIENT_TIMEOUT).status_code == 200
    assert httpx.get(f"{base}/metrics", timeout=CLIENT_TIMEOUT).status_code == 200


def test_without_router_key_the_clients_authorization_passes_through(fakes: Any, router: Any) -> None:
    a = fakes("A")
    base = router([backend(a, "m1")])
    assert complete(base, headers={"authorization": "Bearer client-key"}).status_code == 200
    assert a.control.requests[-1]["headers"]["authorization"] == "Bearer client-key"


def test_request_id_is_forwarded_returned_and_logged(
    fakes: Any, router: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pagoda.router")
    a = fakes("A")
    base = router([backend(a, "m1")])
    response = complete(base, headers={"x-request-id": "client-id-123"})
    assert response.headers["x-request-id"] == "client-id-123"
    assert a.control.requests[-1]["headers"]["x-request-id"] == "client-id-123"
    response = complete(base)
    generated = response.headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", generated)
    assert a.control.requests[-1]["headers"]["x-request-id"] == generated
    assert (
        complete(base, headers={"x-request-id": "bad id with spaces"}).headers["x-request-id"]
        != "bad id with spaces"
    )
    assert_openai_error(complete(base, "nope", headers={"x-request-id": "err-1"}), 404)
    assert complete(base, "nope", headers={"x-request-id": "err-1"}).headers["x-request-id"] == "err-1"
    wait_until(lambda: any(generated in r.getMessage() for r in caplog.records))


def test_metrics_count_requests_and_latency(fakes: Any, router: Any) -> None:
    a = fakes("A")
    base = router([backend(a, "m1")])
    for _ in range(3):
        complete(base)
    stream_raw(base, "/v1/completions", {"model": "m1", "prompt": "hi", "stream": True})
    text = httpx.get(f"{base}/metrics", timeout=CLIENT_TIMEOUT).text
    assert f'pagoda_router_requests_total{{backend="{a.url}",status="200"}} 4.0' in text
    assert f'pagoda_router_in_flight_requests{{backend="{a.url}"}} 0.0' in text
    assert 'pagoda_router_request_duration_seconds_count{endpoint="completion"} 4.0' in text
    assert 'pagoda_router_policy_decisions_total{policy="cache-aware",reason="cache_miss"} 1.0' in text


# ---------------------------------------------------------------- launch


def _free_port_range(n: int) -> int:
    for _ in range(50):
        base = random.randint(20000, 60000)
        try:
            socks = []
            for port in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind((LOOPBACK, port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range found")


# A replica for the launch tests: stdlib only, so that it starts in a blink. Usage: MODEL --host H --port P.
LIGHT_REPLICA = """
import json, os, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
model, host, port = sys.argv[1], sys.argv[3], int(sys.argv[5])
assert sys.argv[2] == "--host" and sys.argv[4] == "--port" and host == "127.0.0.1"
open(os.path.join(os.environ["PAGODA_FAKE_PID_DIR"], f"{port}.pid"), "w").write(str(os.getpid()))

class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *args):
        pass
    def reply(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def do_GET(self):
        if self.path == "/v1/models":
            self.reply({"object": "list", "data": [{"id": model, "object": "model"}]})
        else:
            self.reply({"status": "ok"})
    def do_POST(self):
        self.rfile.read(int(self.headers["content-length"]))
        self.reply({"choices": [{"index": 0, "text": f"fake{port}-answer", "finish_reason": "stop"}]})

ThreadingHTTPServer((host, port), Handler).serve_forever()
"""


def _start_launcher(tmp_path: Path, replicas: int) -> tuple[subprocess.Popen[str], int, Path]:
    base_port = _free_port_range(replicas + 1)
    router_port = base_port + replicas
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    replica = tmp_path / "replica.py"
    replica.write_text(LIGHT_REPLICA)
    code = (
        "import sys; from pagoda.router.launch import launch_replicas; "
        f"sys.exit(launch_replicas(['m1'], {replicas}, {base_port}, '{LOOPBACK}', {router_port}, 'round-robin', "
        f"server_command=[sys.executable, {str(replica)!r}], startup_timeout_s=60, log_level='warning'))"
    )
    env = {**os.environ, "PYTHONPATH": SRC, "PAGODA_FAKE_PID_DIR": str(pid_dir)}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, text=True)
    router_url = f"http://{LOOPBACK}:{router_port}"

    def router_up() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"launcher exited early with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{router_url}/health", timeout=1.0).json()["status"] == "ok"
        return False

    wait_until(router_up, 60)
    return proc, router_port, pid_dir


def _pids(pid_dir: Path) -> list[int]:
    return [int(p.read_text()) for p in pid_dir.iterdir()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # the launcher reaps its children, so a stopped replica disappears entirely
    except ProcessLookupError:
        return False
    return True


def test_launch_serves_through_the_router_and_stops_everything_on_sigterm(tmp_path: Path) -> None:
    proc, router_port, pid_dir = _start_launcher(tmp_path, replicas=2)
    try:
        base = f"http://{LOOPBACK}:{router_port}"
        assert {served_by(complete(base)) for _ in range(4)} == _replica_names(base)
        pids = _pids(pid_dir)
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        wait_until(lambda: not any(_alive(p) for p in pids), 10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def _replica_names(base: str) -> set[str]:
    health = httpx.get(f"{base}/health", timeout=CLIENT_TIMEOUT).json()
    return {f"fake{b['url'].rsplit(':', 1)[1]}" for b in health["backends"]}


def test_launch_stops_everything_when_a_replica_dies(tmp_path: Path) -> None:
    proc, _, pid_dir = _start_launcher(tmp_path, replicas=2)
    try:
        pids = _pids(pid_dir)
        os.kill(pids[0], signal.SIGKILL)
        assert proc.wait(timeout=30) == 1
        wait_until(lambda: not any(_alive(p) for p in pids), 10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_launch_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="replicas must be"):
        launch_replicas(["m"], 0, 9000)
    with pytest.raises(ValueError, match="collides with the replica ports"):
        launch_replicas(["m"], 2, 9000, router_port=9001)
    with pytest.raises(ValueError, match="model_args"):
        launch_replicas([], 1, 9000)
    with pytest.raises(ValueError, match="unknown routing policy"):
        launch_replicas(["m"], 1, 9000, router_port=9100, policy="fastest")
    with socket.socket() as busy:
        busy.bind((LOOPBACK, 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        with pytest.raises(ValueError, match=f"cannot use port {port}"):
            launch_replicas(["m"], 1, port, router_port=port - 1 if port > 1 else port + 1)


# ---------------------------------------------------------------- real pagoda servers


@pytest.fixture(scope="module")
def real_servers(request: pytest.FixtureRequest) -> list[str]:
    """Two real `pagoda serve` processes on the same tiny model: the session's shared server and one
    more from the factory (started in parallel, so the module waits for one startup, not two)."""
    try:
        factory = request.getfixturevalue("pagoda_server_factory")
        model_dir = request.getfixturevalue("tiny_llama_dir")
    except pytest.FixtureLookupError as exc:
        pytest.skip(f"needs the fixtures that start real pagoda servers: {exc.argname}")
    started: list[str] = []
    failed: list[BaseException] = []

    def start_second() -> None:
        try:
            started.append(factory(model_dir))
        except BaseException as exc:
            failed.append(exc)

    thread = threading.Thread(target=start_second, daemon=True)
    thread.start()
    first = request.getfixturevalue("pagoda_server")
    thread.join(timeout=300)
    if failed or not started:
        raise RuntimeError(f"the second pagoda server did not start: {failed}")
    return [first, started[0]]


def _model_of(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=CLIENT_TIMEOUT).json()["data"][0]["id"]


def _stream_text(base: str, model: str, prompt: str) -> tuple[str, str | None]:
    """The streamed text and finish reason of a greedy completion (ids and timestamps differ per server)."""
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True}
    status, chunks = stream_raw(base, "/v1/completions", body)
    assert status == 200
    text, finish = "", None
    for event in b"".join(chunks).split(b"\n\n"):
        if event.startswith(b"data: ") and event != b"data: [DONE]":
            choice = json.loads(event[6:])["choices"][0]
            text += choice.get("text") or ""
            finish = choice.get("finish_reason") or finish
    return text, finish


def test_real_servers_through_the_router_equal_direct_for_every_policy(
    real_servers: list[str], router: Any
) -> None:
    model = _model_of(real_servers[0])
    assert _model_of(real_servers[1]) == model
    prompts = ["Hello, my name is", "The capital of France is", "Hello, my name is Bob and"]
    direct = [_stream_text(real_servers[0], model, p) for p in prompts]
    assert direct == [_stream_text(real_servers[1], model, p) for p in prompts]  # same weights, greedy
    for policy in sorted(POLICIES):
        base = router([BackendConfig(u) for u in real_servers], policy=policy, seed=0)
        assert [_stream_text(base, model, p) for p in prompts] == direct, policy
        used = [b for b in state_of(router).pool.backends if b.healthy]
        assert len(used) == 2
    metrics = httpx.get(f"{base}/metrics", timeout=CLIENT_TIMEOUT).text
    for url in real_servers:  # cache-aware (the last) sent the distinct prompts to both servers
        assert f'pagoda_router_requests_total{{backend="{url}",status="200"}}' in metrics


def test_real_server_routing_by_model(real_servers: list[str], router: Any, fakes: Any) -> None:
    model = _model_of(real_servers[0])
    other = fakes("O", ["other-model"])
    base = router([BackendConfig(real_servers[0]), backend(other)])
    with httpx.Client(timeout=CLIENT_TIMEOUT, trust_env=False) as client:
        ids = [m["id"] for m in client.get(f"{base}/v1/models").json()["data"]]
    assert ids == sorted([model, "other-model"])
    assert _stream_text(base, model, "Hello") == _stream_text(real_servers[0], model, "Hello")
    assert served_by(complete(base, "other-model")) == "O"
    assert len(other.control.requests) == 1


def test_real_servers_survive_a_peer_killed_mid_run(real_servers: list[str], router: Any) -> None:
    """A killable fake serving the same model next to two real servers: every stream completes or
    ends with an error event, and afterwards the real servers take all requests."""
    model = _model_of(real_servers[0])
    with fake_subprocess("P", model, chunks=40, chunk_delay_s=0.05) as p:
        backends = [BackendConfig(p.url, (model,)), *(BackendConfig(u) for u in real_servers)]
        base = router(backends, policy="round-robin")

        async def run() -> list[str]:
            seen_first = [asyncio.Event() for _ in range(6)]
            async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT, trust_env=False) as client:

                async def one(i: int) -> str:
                    body = {"model": model, "prompt": f"Count to {i}:", "max_tokens": 16, "stream": True}
                    text = b""
                    async with client.stream("POST", f"{base}/v1/completions", json=body) as response:
                        async for chunk in response.aiter_raw():
                            text += chunk
                            seen_first[i].set()
                    if text.endswith(b"data: [DONE]\n\n"):
                        return "done"
                    return "error_event" if b'"error"' in text.strip().split(b"\n\n")[-1] else "silent"

                tasks = [asyncio.create_task(one(i)) for i in range(6)]
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in seen_first)), 30)
                os.kill(p.pid, signal.SIGKILL)
                return list(await asyncio.wait_for(asyncio.gather(*tasks), 60))

        outcomes = asyncio.run(run())
    assert sorted(outcomes) == ["done"] * 4 + ["error_event"] * 2  # round-robin gave P two of six
    assert all(_stream_text(base, model, f"after {i}")[1] is not None for i in range(3))


# ---------------------------------------------------------------- fake backend process


def _serve_fake_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--name", default=None)
    parser.add_argument("--host", default=LOOPBACK)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--chunk-delay", type=float, default=0.0)
    args = parser.parse_args(argv)
    if args.host != LOOPBACK:
        raise SystemExit("the fake backend only listens on loopback")
    control = FakeControl(chunks=args.chunks, chunk_delay_s=args.chunk_delay)
    sock = tcp_listen_socket(args.port)
    port = sock.getsockname()[1]
    name = args.name or f"fake{port}"
    server = uvicorn.Server(uvicorn.Config(make_fake_app(name, [args.model], control), log_level="critical"))
    print(f"PORT {port}", flush=True)
    server.run(sockets=[sock])


if __name__ == "__main__" and sys.argv[1:2] == ["--serve-fake"]:
    _serve_fake_main(sys.argv[2:])
