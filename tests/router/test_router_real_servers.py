"""The router in front of real `pagoda serve` processes."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
from typing import Any

import httpx
import pytest
from fakes import (
    CLIENT_TIMEOUT,
    backend,
    complete,
    fake_subprocess,
    served_by,
    state_of,
    stream_raw,
)

from pagoda.router.config import BackendConfig
from pagoda.router.policies import POLICIES

pytestmark = pytest.mark.timeout(90)

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
