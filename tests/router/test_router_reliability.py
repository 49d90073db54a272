"""The router's side of reliability: bodies that are not JSON text get a 400 naming the field
before any backend sees them, a body over the limit is a 413, API keys are compared as bytes, and a
real `pagoda serve` killed in the middle of a run: its streams end with an error event at once
(not at the read timeout), it is taken out of rotation, and only requests that had sent nothing
to their client are retried on the other backend."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from typing import Any

import httpx
import pytest
from fakes import CLIENT_TIMEOUT, assert_openai_error, backend, state_of

from pagoda.router.config import BackendConfig
from server_utils import parse_metrics

pytestmark = pytest.mark.timeout(240)


def _post(base: str, raw: bytes, headers: dict | None = None) -> httpx.Response:
    headers = {"content-type": "application/json", **(headers or {})}
    with httpx.Client(timeout=CLIENT_TIMEOUT, trust_env=False) as client:
        return client.post(f"{base}/v1/completions", content=raw, headers=headers)


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b'{"model": "m1", "prompt": "\\ud800"}', "prompt"),
        (b'{"model": "m1", "prompt": "\xff\xfe"}', "prompt"),
        (b'{"model": "m1", "messages": [{"role": "user", "content": "\\udc00"}]}', "messages.0.content"),
        (b'{"model": "\\ud800"}', "model"),
        (b'{"model": "m1", "prompt": "hi", "temperature": NaN}', "temperature"),
        (b'{"model": "m1", "prompt": "hi", "top_p": 1e400}', "top_p"),
    ],
)
def test_text_that_is_not_unicode_never_reaches_a_backend(
    fakes: Any, router: Any, raw: bytes, param: str
) -> None:
    a = fakes("A")
    base = router([backend(a, "m1")])
    error = assert_openai_error(_post(base, raw), 400, "invalid_json")
    assert error["param"] == param
    assert a.control.requests == []
    assert _post(base, b'{"model": "m1", "prompt": "ok"}').status_code == 200


def test_a_body_over_the_limit_is_a_413(fakes: Any, router: Any) -> None:
    a = fakes("A")
    base = router([backend(a, "m1")], max_body_size=1000)
    big = json.dumps({"model": "m1", "prompt": "x" * 2000}).encode()
    error = assert_openai_error(_post(base, big), 413, "request_too_large")
    assert "1000 bytes" in error["message"]

    def chunks():  # no content-length header
        yield big[:600]
        yield big[600:]

    with httpx.Client(timeout=CLIENT_TIMEOUT, trust_env=False) as client:
        response = client.post(
            f"{base}/v1/completions", content=chunks(), headers={"content-type": "application/json"}
        )
    assert_openai_error(response, 413, "request_too_large")
    assert a.control.requests == []
    assert _post(base, b'{"model": "m1", "prompt": "ok"}').status_code == 200


def test_api_keys_are_compared_as_bytes(fakes: Any, router: Any) -> None:
    a = fakes("A")
    key = "router-clé"
    base = router([backend(a, "m1")], api_key=key)
    for header in (b"Bearer router-cl\xe9", b"Bearer \xff", b"Bearer wrong", b"Basic x"):
        assert_openai_error(
            _post(base, b'{"prompt": "hi"}', {"authorization": header}), 401, "invalid_api_key"
        )
    ok = _post(base, b'{"prompt": "hi"}', {"authorization": f"Bearer {key}".encode()})
    assert ok.status_code == 200, ok.text


# ---------------------------------------------------------------- a real backend killed mid-run
@pytest.fixture
def victim(tiny_llama_dir: str):
    """A `pagoda serve` process that the test SIGKILLs."""
    from server_utils import ServerProcess, flags_to_args

    server = ServerProcess(tiny_llama_dir, flags_to_args({"dtype": "float32", "num_kv_blocks": 512})).start()
    yield server
    server.kill()


def test_a_real_backend_killed_mid_run(victim: Any, pagoda_server: str, router: Any) -> None:
    # A long read timeout: a stream that ends within the client's wait ended because the router saw
    # the connection break, not because it timed out.
    base = router(
        [BackendConfig(victim.base_url), BackendConfig(pagoda_server)],
        policy="round-robin",
        read_timeout_s=600,
    )
    model = httpx.get(f"{pagoda_server}/v1/models", timeout=CLIENT_TIMEOUT).json()["data"][0]["id"]
    long = {"model": model, "max_tokens": 480, "temperature": 0, "ignore_eos": True}

    async def run() -> tuple[list[str], list[int]]:
        first_bytes = [asyncio.Event() for _ in range(4)]
        async with httpx.AsyncClient(base_url=base, timeout=60.0, trust_env=False) as client:

            async def stream(i: int) -> str:
                body = {**long, "prompt": f"stream {i}", "stream": True}
                text = b""
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    assert response.status_code == 200
                    async for chunk in response.aiter_raw():
                        text += chunk
                        first_bytes[i].set()
                if text.endswith(b"data: [DONE]\n\n"):
                    return "done"
                last = json.loads(text.strip().split(b"\n\n")[-1].removeprefix(b"data: "))
                return "error_event" if "error" in last else "truncated silently"

            async def whole(i: int) -> int:
                response = await client.post("/v1/completions", json={**long, "prompt": f"whole {i}"})
                return response.status_code

            streams = [asyncio.create_task(stream(i)) for i in range(4)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in first_bytes)), 60)
            wholes = [asyncio.create_task(whole(i)) for i in range(4)]  # two go to the victim
            # Kill once the victim runs all four of its requests (two streams, two whole ones).
            async with httpx.AsyncClient(base_url=victim.base_url, timeout=10.0, trust_env=False) as direct:
                while parse_metrics((await direct.get("/metrics")).text)["vllm:num_requests_running"] < 4:
                    assert not any(t.done() for t in (*streams, *wholes)), "a request ended before the kill"
                    await asyncio.sleep(0.005)
            os.kill(victim.process.pid, signal.SIGKILL)
            return list(await asyncio.gather(*streams)), list(await asyncio.gather(*wholes))

    stream_outcomes, whole_statuses = asyncio.run(run())
    # Round-robin gave the victim half of the streams: they report the failure, the others finish.
    assert sorted(stream_outcomes) == ["done", "done", "error_event", "error_event"], stream_outcomes
    # Non-streamed requests had sent nothing to their client: retried on the healthy backend.
    assert whole_statuses == [200] * 4
    pool = state_of(router).pool
    assert not pool.backend(victim.base_url).healthy  # taken out at once, not at a health check
    assert pool.backend(pagoda_server).healthy
    metrics = httpx.get(f"{base}/metrics", timeout=CLIENT_TIMEOUT).text
    assert f'pagoda_router_retries_total{{backend="{victim.base_url}"}}' in metrics
    with httpx.Client(base_url=base, timeout=60.0, trust_env=False) as client:
        for i in range(3):
            after = client.post("/v1/completions", json={**long, "max_tokens": 2, "prompt": f"after {i}"})
            assert after.status_code == 200
