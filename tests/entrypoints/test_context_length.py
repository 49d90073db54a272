"""One max_tokens policy offline and in the server: prompt + max_tokens over the context is rejected with
the same message; max_tokens=None means "up to the context" on both paths."""

from __future__ import annotations

import types

import pytest

from pagoda import LLM, SamplingParams
from pagoda.entrypoints.openai.errors import APIError
from pagoda.entrypoints.openai.serving_common import ServerState

MAX_MODEL_LEN = 64
PROMPT = list(range(5, 15))  # 10 tokens
EXPECTED = (
    "This model's maximum context length is 64 tokens. However, you requested 65 tokens "
    "(10 in the prompt, 55 for the completion). Shorten the prompt or lower {param}."
)


@pytest.fixture(scope="module")
def llm(tiny_model_dirs) -> LLM:
    return LLM(
        tiny_model_dirs["LlamaForCausalLM"], dtype="float32", num_kv_blocks=32, max_model_len=MAX_MODEL_LEN
    )


def _assert_idle(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    engine.core.check_invariants()
    engine.reset_prefix_cache()
    assert engine.core.kv.pool.num_free == engine.core.kv.num_blocks


def test_offline_rejects_max_tokens_beyond_the_context(llm: LLM) -> None:
    with pytest.raises(ValueError) as info:
        llm.generate(PROMPT, SamplingParams(max_tokens=55))
    assert str(info.value) == EXPECTED.format(param="max_tokens")
    # In a batch, nothing is queued when one request is rejected.
    with pytest.raises(ValueError, match="maximum context length is 64"):
        llm.generate([PROMPT, PROMPT], [SamplingParams(max_tokens=4), SamplingParams(max_tokens=55)])
    _assert_idle(llm)


def test_offline_max_tokens_up_to_the_context(llm: LLM) -> None:
    greedy = {"temperature": 0.0, "ignore_eos": True}
    exact, unbounded = llm.generate(
        [PROMPT, PROMPT], [SamplingParams(max_tokens=54, **greedy), SamplingParams(max_tokens=None, **greedy)]
    )
    for out in (exact, unbounded):
        assert len(out.outputs[0].token_ids) == MAX_MODEL_LEN - len(PROMPT)
        assert out.outputs[0].finish_reason == "length"
    assert exact.outputs[0].token_ids == unbounded.outputs[0].token_ids
    _assert_idle(llm)


def test_server_rejects_with_the_same_message() -> None:
    engine = types.SimpleNamespace(max_model_len=MAX_MODEL_LEN)
    state = ServerState(engine, metrics=None, model_names=["m"], model_path="m")  # type: ignore[arg-type]
    for param in ("max_tokens", "max_completion_tokens"):
        with pytest.raises(APIError) as info:
            state.check_length(len(PROMPT), SamplingParams(max_tokens=55), param)
        assert (info.value.status, info.value.param) == (400, param)
        assert info.value.message == EXPECTED.format(param=param)
    state.check_length(len(PROMPT), SamplingParams(max_tokens=54))  # exactly the context fits
    state.check_length(len(PROMPT), SamplingParams(max_tokens=None))  # None: up to the context
