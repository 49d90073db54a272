"""The abort soak (`pagoda bench soak`) against a server running in this process, so that the
test can also check the engine's block accounting invariant afterwards. The default run is
short (200 requests); the `slow` one is the full 1,000. Both require: every aborted stream
cleaned up (0 running, 0 waiting, 0 KV blocks held after every round), no request failing,
resident memory within 5% between the second round and the last, and the same greedy output
before and after."""

from __future__ import annotations

import asyncio

import pytest

from inproc_server import serve_in_thread
from pagoda.bench.soak import SoakConfig, run_soak

pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def served(tiny_llama_dir: str):
    """(base URL, ServerState) of a pagoda app served by uvicorn on a thread of this process."""
    from pagoda.config import EngineArgs
    from pagoda.engine.llm_engine import LLMEngine
    from pagoda.entrypoints.openai.app import build_state, create_app
    from pagoda.entrypoints.server_args import ServerArgs

    engine = LLMEngine(EngineArgs(model=tiny_llama_dir, dtype="float32", num_kv_blocks=512))
    state = build_state(engine, ServerArgs())
    with serve_in_thread(create_app(state)) as url:
        yield url, state
    state.engine.shutdown()


def _soak(served, num_requests: int, rounds: int) -> None:
    base, state = served
    config = SoakConfig(base_url=base, num_requests=num_requests, rounds=rounds, concurrency=16, seed=rounds)
    result = asyncio.run(run_soak(config))
    assert result.ok, "\n".join(result.problems)
    kinds = {key.split(":")[0] for r in result.rounds for key in r.outcomes}
    assert kinds >= {
        "abort_before_response",
        "abort_in_prefill",
        "abort_in_decode",
        "structured",
        "n_samples",
    }
    assert (
        sum(n for r in result.rounds for k, n in r.outcomes.items() if k.endswith(":aborted"))
        > num_requests / 4
    )
    assert result.memory_growth is not None  # the server reports its resident memory
    assert result.reference_text and result.final_text == result.reference_text

    async def invariants() -> None:
        await state.engine.call(lambda engine: engine.core.check_invariants())

    asyncio.run(invariants())


def test_abort_soak_short(served) -> None:
    _soak(served, num_requests=200, rounds=4)


@pytest.mark.slow
def test_abort_soak_full(served) -> None:
    _soak(served, num_requests=1000, rounds=10)
