"""Fake OpenAI-compatible backends for the router tests: small FastAPI apps on free loopback
ports (in threads, or in a subprocess when a test must kill one) that stream deterministic SSE, fail
with 500, hang, die before or in the middle of a stream, or drop the connection. Every wait is bounded.

Run as a script (`python tests/router/fakes.py --serve-fake MODEL --port P`) this file serves one fake
backend: the failover tests start it that way so that they can kill it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
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
import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

SRC = str(Path(__file__).resolve().parents[2] / "src")
if SRC not in sys.path:  # when run as a script
    sys.path.insert(0, SRC)

from pagoda.router.config import BackendConfig  # noqa: E402

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
    # Listening before the port is announced: connections wait in the backlog until uvicorn runs,
    # instead of being refused (a health check right after startup would fail on a loaded machine).
    sock.listen(128)
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
