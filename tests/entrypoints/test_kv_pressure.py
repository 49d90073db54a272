"""Issue 15's KV-pressure fault test: more concurrent long requests than the KV pool holds. The
server preempts (the metric shows it), completes every request with the output it gives alone,
answers 200 throughout, and is left with no request running or waiting and no block held. The
server runs with PAGODA_CHECK_INVARIANTS=1 (inherited from tests/conftest.py), so a block
accounting error on any step would fail the engine and every request after it."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from server_utils import metrics, start_server, wait_idle

pytestmark = pytest.mark.timeout(300)

# 24 blocks of 4 tokens = 96 slots; each request needs about 11 blocks (prompt ~18 + 24 tokens),
# so eight at once need about 88: the scheduler must preempt and resume.
NUM_BLOCKS, BLOCK_SIZE, MAX_TOKENS = 24, 4, 24
PROMPTS = [f"Request {i}: the quick brown fox jumps over the lazy dog {i} times" for i in range(8)]


@pytest.fixture(scope="module")
def small_pool_server(tiny_llama_dir: str):
    server = start_server(
        tiny_llama_dir,
        dtype="float32",
        num_kv_blocks=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=64,
    )
    yield server.base_url
    server.stop()


def _body(prompt: str) -> dict:
    return {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
    }


async def _complete_all(base: str, prompts: list[str]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=base, timeout=120.0) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        return await asyncio.gather(
            *(client.post("/v1/completions", json={**_body(p), "model": model}) for p in prompts)
        )


def test_kv_exhaustion_preempts_and_completes_everything_exactly(small_pool_server: str) -> None:
    base = small_pool_server
    alone = []
    for prompt in PROMPTS:  # one at a time: the reference, and no preemption needed
        (response,) = asyncio.run(_complete_all(base, [prompt]))
        assert response.status_code == 200, response.text
        alone.append(response.json()["choices"][0]["text"])
    before = metrics(base)["vllm:num_preemptions_total"]

    responses = asyncio.run(_complete_all(base, PROMPTS))

    assert [r.status_code for r in responses] == [200] * len(PROMPTS), [r.text for r in responses]
    choices = [r.json()["choices"][0] for r in responses]
    assert [c["finish_reason"] for c in choices] == ["length"] * len(PROMPTS)
    assert [r.json()["usage"]["completion_tokens"] for r in responses] == [MAX_TOKENS] * len(PROMPTS)
    assert [c["text"] for c in choices] == alone
    after = wait_idle(base, timeout_s=30.0)
    assert after["vllm:num_preemptions_total"] > before, "the pool was meant to be too small"
    assert httpx.get(base + "/health", timeout=10.0).status_code == 200
