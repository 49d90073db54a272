"""The router against fake backends: routing by model and policy, streaming, failures and retries, auth, request ids and metrics."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
from fakes import (
    CLIENT_TIMEOUT,
    ClosingServer,
    assert_openai_error,
    backend,
    complete,
    fake_subprocess,
    served_by,
    sse_chunks,
    state_of,
    stream_raw,
    wait_until,
)

from pagoda.router.config import BackendConfig
from pagoda.router.policies import POLICIES, CacheAwareConfig

pytestmark = pytest.mark.timeout(90)

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
