"""AsyncLLM: the engine on a background thread, one asyncio stream per request, aborts on cancel."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest

from pagoda.config import EngineArgs
from pagoda.engine.async_engine import AsyncLLM, EngineDeadError, EngineOverloadedError
from pagoda.engine.llm_engine import LLMEngine
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(120)

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: str) -> LLMEngine:
    """One engine for the module; each test wraps it in its own AsyncLLM and shuts that down."""
    return LLMEngine(EngineArgs(model=tiny_llama_dir, dtype="float32", num_kv_blocks=128))


def _assert_idle(engine: LLMEngine) -> None:
    """Call after AsyncLLM.shutdown(): nothing is left queued, running or holding KV blocks."""
    assert not engine.has_unfinished_requests()
    assert not engine.core.scheduler.running and not engine.core.scheduler.waiting
    assert engine.core.kv.usage == 0
    engine.core.check_invariants()


def _sync_generate(engine: LLMEngine, prompt, params: SamplingParams) -> RequestOutput:
    rid = engine.add_request(None, prompt, params)
    while True:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out


def _run(engine: LLMEngine, test, **kwargs):
    """Run `test(llm)` on a fresh AsyncLLM around `engine`; always shut it down, then check idleness."""

    async def main():
        llm = AsyncLLM(engine, **kwargs)
        try:
            return await asyncio.wait_for(test(llm), 60)
        finally:
            await asyncio.to_thread(llm.shutdown)

    result = asyncio.run(main())
    _assert_idle(engine)
    return result


def test_deltas_add_up_to_the_offline_result(engine: LLMEngine) -> None:
    prompts = ["Hello world", "你好，世界 😀", [3, 14, 159, 26]]
    expected = [_sync_generate(engine, p, GREEDY).outputs[0] for p in prompts]

    async def test(llm: AsyncLLM):
        results = []
        for prompt in prompts:
            deltas = [out async for out in llm.generate(prompt, GREEDY)]
            assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
            whole = [out async for out in llm.generate(prompt, GREEDY, stream=False)]
            assert len(whole) == 1 and whole[0].finished
            results.append((deltas, whole[0]))
        return results

    for want, (deltas, whole) in zip(expected, _run(engine, test), strict=True):
        assert "".join(c.text for d in deltas for c in d.outputs) == want.text == whole.outputs[0].text
        assert [t for d in deltas for c in d.outputs for t in c.token_ids] == want.token_ids
        assert whole.outputs[0].token_ids == want.token_ids
        assert deltas[-1].outputs[-1].finish_reason == "length"


def test_validation_errors_surface_before_the_first_output(engine: LLMEngine) -> None:
    async def test(llm: AsyncLLM):
        for prompt, params, words in [
            ("x" * 600, GREEDY, "max_model_len"),
            ("", GREEDY, "empty"),
            ([10**6], GREEDY, "token id"),
            ("ok", "not params", "SamplingParams"),
        ]:
            with pytest.raises(ValueError, match=words):
                await anext(llm.generate(prompt, params))
        # All-or-nothing: one bad prompt among several adds none of them.
        with pytest.raises(ValueError, match="empty"):
            await llm.add_requests(["a", "b"], ["fine", ""], GREEDY)
        stream = await llm.add_requests(["a", "b"], ["fine", "also fine"], GREEDY, stream=False)
        return [out async for out in stream]

    outs = _run(engine, test)
    assert sorted(o.request_id for o in outs) == ["a", "b"]


async def _first_output_then(llm: AsyncLLM, params: SamplingParams, action) -> list[RequestOutput]:
    """Start a long request, wait for its first output, run `action(llm, task)`; returns its outputs."""
    seen: list[RequestOutput] = []
    first = asyncio.Event()

    async def consume():
        async for out in llm.generate("Go on and on", params, "long"):
            seen.append(out)
            first.set()

    task = asyncio.create_task(consume())
    await first.wait()
    await action(llm, task)
    return seen


def test_cancelling_the_consumer_aborts_the_request(engine: LLMEngine) -> None:
    published: list[RequestOutput] = []

    async def cancel(llm: AsyncLLM, task: asyncio.Task) -> None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        for _ in range(500):  # the abort reaches the engine thread a moment later
            if any(o.request_id == "long" and o.finished for o in published):
                return
            await asyncio.sleep(0.01)

    async def test(llm: AsyncLLM):
        return await _first_output_then(llm, LONG, cancel)

    seen = _run(engine, test, on_step=lambda outs, _stats: published.extend(outs))
    final = [o for o in published if o.request_id == "long" and o.finished]
    assert len(final) == 1 and final[0].outputs[0].finish_reason == "abort"
    assert len(seen) < 50  # it did not run to its 400 tokens


def test_leaving_the_loop_early_aborts_the_request(engine: LLMEngine) -> None:
    async def test(llm: AsyncLLM):
        stream = await llm.add_requests(["r"], ["Go on"], LONG)
        async with stream:
            async for _ in stream:
                break
        assert stream.finished  # no longer pending: the abort was sent
        # Same id can be reused once the abort went through.
        return [o async for o in llm.generate("Again", GREEDY, "r")]

    outs = _run(engine, test)
    assert outs[-1].finished and outs[-1].outputs[-1].finish_reason == "length"


class _Parking:
    """An `on_step` observer that can park the engine thread after a step, so that adds queue up
    meanwhile; it keeps every output the engine publishes."""

    def __init__(self) -> None:
        self.hold, self.held, self.release = threading.Event(), threading.Event(), threading.Event()
        self.published: list[RequestOutput] = []

    def on_step(self, outs, _stats) -> None:
        self.published.extend(outs)
        if self.hold.is_set():
            self.held.set()
            self.release.wait(30)

    async def park(self, llm: AsyncLLM):
        """Start a long request and park the engine after a step of it; returns its stream (the
        engine runs on once `release` is set)."""
        long = await llm.add_requests(["long"], ["Go on and on"], LONG)
        await anext(long)
        self.hold.set()
        await asyncio.to_thread(self.held.wait, 30)
        self.hold.clear()
        return long


def test_full_waiting_queue_raises_overloaded(engine: LLMEngine) -> None:
    parking = _Parking()

    async def test(llm: AsyncLLM):
        long = await parking.park(llm)
        adds = [asyncio.create_task(llm.add_requests([f"r{i}"], ["Hi"], GREEDY)) for i in range(3)]
        await asyncio.sleep(0.05)  # every add is in the engine's command queue now
        parking.release.set()
        results = await asyncio.gather(*adds, return_exceptions=True)
        long.abort()
        return results

    accepted, *rejected = _run(engine, test, max_waiting_requests=1, on_step=parking.on_step)
    assert not isinstance(accepted, BaseException)
    assert all(isinstance(r, EngineOverloadedError) for r in rejected), rejected
    assert "max_waiting_requests=1" in str(rejected[0])


def test_cancelled_while_being_added_is_aborted(engine: LLMEngine) -> None:
    parking = _Parking()
    published = parking.published

    async def test(llm: AsyncLLM):
        long = await parking.park(llm)
        add = asyncio.create_task(llm.add_requests(["late"], ["Hi"], LONG))
        await asyncio.sleep(0.05)
        add.cancel()  # the add is queued but not yet accepted
        parking.release.set()
        with pytest.raises(asyncio.CancelledError):
            await add
        for _ in range(500):
            if any(o.request_id == "late" and o.finished for o in published):
                break
            await asyncio.sleep(0.01)
        long.abort()

    _run(engine, test, on_step=parking.on_step)
    (final,) = [o for o in published if o.request_id == "late" and o.finished]
    assert final.outputs[0].finish_reason == "abort"


def test_a_failing_step_kills_the_engine_cleanly(engine: LLMEngine) -> None:
    calls = []

    def on_step(_outs, _stats) -> None:
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom")

    async def test(llm: AsyncLLM):
        with pytest.raises(EngineDeadError, match="boom"):
            async for _ in llm.generate("Go on", LONG):
                pass
        assert not llm.is_running and isinstance(llm.error, RuntimeError)
        with pytest.raises(EngineDeadError, match="boom"):
            await anext(llm.generate("Hi", GREEDY))

    _run(engine, test, on_step=on_step)


def test_a_model_that_raises_fails_every_in_flight_request(engine: LLMEngine, monkeypatch) -> None:
    """Issue 15's fault: the model raises on a chosen forward pass. Every in-flight request (streamed
    or not) gets the error, the engine says it is not running, the error callback fires once."""
    model = engine.core.executor.worker.model
    calls = []

    def forward(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("injected fault on forward pass 4")
        return type(model).forward(model, *args, **kwargs)

    monkeypatch.setattr(model, "forward", forward)
    errors: list[BaseException] = []

    async def test(llm: AsyncLLM):
        streamed = await llm.add_requests(["s"], ["Go on"], LONG)
        whole = await llm.add_requests(["w"], ["And on"], LONG, stream=False)
        with pytest.raises(EngineDeadError, match="injected fault"):
            async for _ in streamed:
                pass
        with pytest.raises(EngineDeadError, match="injected fault"):
            await anext(whole)
        assert not llm.is_running
        with pytest.raises(EngineDeadError, match="injected fault"):
            await llm.add_requests(["late"], ["Hi"], GREEDY)

    _run(engine, test, on_error=errors.append)
    assert len(errors) == 1 and "injected fault" in str(errors[0])


def test_shutdown_aborts_in_flight_requests(engine: LLMEngine) -> None:
    async def shutdown(llm: AsyncLLM, task: asyncio.Task) -> None:
        await asyncio.to_thread(llm.shutdown)
        await task

    async def test(llm: AsyncLLM):
        seen = await _first_output_then(llm, LONG, shutdown)
        with pytest.raises(EngineDeadError, match="shut down"):
            await anext(llm.generate("Hi", GREEDY))
        return seen

    seen = _run(engine, test)
    assert seen[-1].finished and seen[-1].outputs[-1].finish_reason == "abort"


def test_parallel_requests_and_n_match_sequential(engine: LLMEngine) -> None:
    prompts = [f"Prompt number {i}" for i in range(8)]
    expected = [_sync_generate(engine, p, GREEDY).outputs[0].text for p in prompts]
    sampled = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8)

    async def test(llm: AsyncLLM):
        async def text(p: str) -> str:
            return "".join([c.text async for o in llm.generate(p, GREEDY) for c in o.outputs])

        parallel = await asyncio.gather(*(text(p) for p in prompts))
        by_index: dict[int, str] = {}
        async for out in llm.generate("Sample me", sampled):
            for c in out.outputs:
                by_index[c.index] = by_index.get(c.index, "") + c.text
        (whole,) = [o async for o in llm.generate("Sample me", sampled, stream=False)]
        return parallel, by_index, whole

    parallel, by_index, whole = _run(engine, test)
    assert parallel == expected
    assert by_index == {c.index: c.text for c in whole.outputs} and sorted(by_index) == [0, 1, 2]
