"""Issue 15's engine fault: a model that raises on a chosen forward pass. In-flight requests get an
error event, /health turns 503, and `pagoda serve` exits non-zero (so a supervisor restarts it);
nothing hangs. Also: one request failing (finish_reason "error") is that request's error only."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap

import httpx
import pytest

from pagoda.config import EngineArgs
from pagoda.engine.llm_engine import LLMEngine
from pagoda.entrypoints.openai.app import build_state, create_app
from pagoda.entrypoints.openai.errors import APIError
from pagoda.entrypoints.openai.serving_common import GenerationError, checked, collect, error_event
from pagoda.entrypoints.server_args import ServerArgs
from pagoda.outputs import CompletionOutput, RequestOutput
from server_utils import SRC_DIR, ServerProcess, free_port

pytestmark = pytest.mark.timeout(240)

# Imported by the server process before the CLI runs: the model raises on forward pass FAIL_AT.
_FAULTY_SERVE = textwrap.dedent(
    """
    import os, sys
    from pagoda.worker import worker

    load = worker.load_model
    fail_at = int(os.environ["PAGODA_TEST_FAIL_AT"])

    def faulty_load(*args, **kwargs):
        model = load(*args, **kwargs)
        forward, calls = model.forward, []

        def failing(*a, **k):
            calls.append(1)
            if len(calls) == fail_at:
                raise RuntimeError(f"injected fault on forward pass {fail_at}")
            return forward(*a, **k)

        model.forward = failing
        return model

    worker.load_model = faulty_load
    from pagoda.entrypoints.cli import main
    sys.exit(main(sys.argv[1:]))
    """
)


def _events(text: str) -> list[str]:
    return [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]


def test_serve_sends_error_events_and_exits_non_zero(tiny_llama_dir: str, tmp_path) -> None:
    script = tmp_path / "faulty_serve.py"
    script.write_text(_FAULTY_SERVE)
    server = ServerProcess(tiny_llama_dir, [], env={"PAGODA_TEST_FAIL_AT": "4"})
    # ServerProcess runs the CLI module; run the faulty wrapper instead with the same arguments.
    server_cmd = [sys.executable, str(script)]
    try:
        _start_with(server, server_cmd)
        body = {
            "model": tiny_llama_dir,
            "prompt": "Go on",
            "max_tokens": 50,
            "stream": True,
            "ignore_eos": True,
        }
        with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            events = _events(response.read().decode())
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert "injected fault" in error["message"] and error["type"] == "service_unavailable_error"
        assert len(events) >= 4  # the tokens before the fault were streamed
        code = server.process.wait(60)  # it stops serving by itself: never a hang
        assert code != 0, server.log()[-2000:]
        assert "injected fault" in server.log()
    finally:
        server.kill()


def _start_with(server: ServerProcess, cmd: list[str]) -> None:
    """ServerProcess.start, with `cmd` in place of `python -m pagoda.entrypoints.cli`."""
    server.port = free_port()
    env = {**os.environ, **server.extra_env}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SRC_DIR, env.get("PYTHONPATH")) if p)
    args = [*cmd, "serve", server.model_dir, "--host", "127.0.0.1", "--port", str(server.port)]
    args += ["--log-level", "warning"]
    with open(server.log_path, "wb") as log:
        server.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
    if not server._wait_healthy(180):
        raise RuntimeError(f"the faulty server did not start; log:\n{server.log()[-4000:]}")


def test_health_turns_503_when_the_engine_dies(tiny_llama_dir: str, monkeypatch) -> None:
    engine = LLMEngine(EngineArgs(model=tiny_llama_dir, dtype="float32", num_kv_blocks=64))
    model = engine.core.executor.worker.model

    def failing(*args, **kwargs):
        raise RuntimeError("injected fault")

    monkeypatch.setattr(model, "forward", failing)
    state = build_state(engine, ServerArgs())
    app = create_app(state)

    async def check() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            assert (await client.get("/health")).status_code == 200
            body = {"model": tiny_llama_dir, "prompt": "Hi", "max_tokens": 5}
            response = await client.post("/v1/completions", json=body)
            assert response.status_code == 503 and "injected fault" in response.json()["error"]["message"]
            assert (await client.get("/health")).status_code == 503

    try:
        asyncio.run(check())
    finally:
        state.engine.shutdown()


class _Outputs:
    """Stands in for a RequestStream: the given outputs, in order."""

    def __init__(self, outputs: list[RequestOutput]) -> None:
        self.outputs = outputs

    async def __aiter__(self):
        for out in self.outputs:
            yield out


def test_a_failed_completion_is_a_500_or_an_error_event() -> None:
    """finish_reason "error" (one request failed, the engine serves on) is that request's error."""
    ok = RequestOutput("a", None, [1], [CompletionOutput(0, "x", [5], None, "length")], True)
    failed = RequestOutput(
        "b",
        None,
        [1],
        [CompletionOutput(0, "", [], None, "error", None, "sampled token 9 is not allowed")],
        True,
    )
    assert asyncio.run(collect(_Outputs([ok]))) == [ok]
    with pytest.raises(APIError) as err:
        asyncio.run(collect(_Outputs([ok, failed])))
    assert err.value.status == 500 and err.value.code == "generation_error"
    assert "sampled token 9" in err.value.message

    async def stream() -> list[str]:
        try:
            return [out.request_id async for out in checked(_Outputs([ok, failed]))]
        except GenerationError as exc:
            return [error_event(exc)]

    (event,) = asyncio.run(stream())
    body = json.loads(event.removeprefix("data: "))["error"]
    assert body["code"] == "generation_error" and "sampled token 9" in body["message"]
