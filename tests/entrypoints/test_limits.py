"""RequestLimits and the strict JSON body parser, and the offline LLM keeping the same rules as the
server (a ValueError naming the field, never silent clamping)."""

from __future__ import annotations

import json

import pytest

from pagoda.http_body import BodyError, parse_json_body
from pagoda.limits import LimitError, RequestLimits, check_context, regex_depth
from pagoda.sampling_params import SamplingParams, StructuredOutputs

SMALL = RequestLimits(
    max_n=4,
    max_sequences=6,
    max_logprobs=5,
    max_stop=2,
    max_stop_chars=8,
    max_logit_bias=3,
    max_messages=3,
    max_prompt_chars=50,
    max_grammar_chars=200,
    max_grammar_depth=4,
)


def _param_of(fn, *args, **kwargs) -> str | None:
    with pytest.raises(LimitError) as info:
        fn(*args, **kwargs)
    assert "--" in str(info.value) or "surrogate" in str(info.value) or "context length" in str(info.value)
    return info.value.param


def _nested_schema(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize(
    ("params", "param"),
    [
        (SamplingParams(n=5), "n"),
        (SamplingParams(logprobs=6), "logprobs"),
        (SamplingParams(stop=["a", "b", "c"]), "stop"),
        (SamplingParams(stop=["123456789"]), "stop"),
        (SamplingParams(stop=["\ud800"]), "stop"),
        (SamplingParams(stop_token_ids=[1, 2, 3]), "stop_token_ids"),
        (SamplingParams(logit_bias={1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0}), "logit_bias"),
        (SamplingParams(structured_outputs=StructuredOutputs(regex="a" * 201)), "structured_outputs.regex"),
        (
            SamplingParams(structured_outputs=StructuredOutputs(regex="(((((a)))))")),
            "structured_outputs.regex",
        ),
        (
            SamplingParams(
                structured_outputs=StructuredOutputs(grammar="root ::= " + "(" * 5 + '"a"' + ")" * 5)
            ),
            "structured_outputs.grammar",
        ),
        (
            SamplingParams(structured_outputs=StructuredOutputs(json=_nested_schema(5))),
            "structured_outputs.json",
        ),
        (
            SamplingParams(structured_outputs=StructuredOutputs(json=json.dumps(_nested_schema(5)))),
            "structured_outputs.json",
        ),
        (
            SamplingParams(structured_outputs=StructuredOutputs(json={"enum": ["x" * 300]})),
            "structured_outputs.json",
        ),
        (
            SamplingParams(structured_outputs=StructuredOutputs(json={"pattern": "(((((a)))))"})),
            "structured_outputs.json",
        ),
        (
            SamplingParams(structured_outputs=StructuredOutputs(choice=["x" * 150, "y" * 60])),
            "structured_outputs.choice",
        ),
    ],
)
def test_each_limit_names_its_field(params: SamplingParams, param: str) -> None:
    assert _param_of(SMALL.check_params, params) == param


def test_requests_within_the_limits_pass() -> None:
    SMALL.check_params(
        SamplingParams(
            n=4,
            logprobs=5,
            stop=["ab", "12345678"],
            stop_token_ids=[1, 2],
            logit_bias={1: 1.0, 2: 1.0, 3: 1.0},
            structured_outputs=StructuredOutputs(json=_nested_schema(4)),
        )
    )
    SMALL.check_params(SamplingParams(structured_outputs=StructuredOutputs(regex="((((a))))[(((((]\\(\\(")))
    # Quoted parentheses in a grammar are text, not nesting.
    SMALL.check_params(SamplingParams(structured_outputs=StructuredOutputs(grammar='root ::= "((((((("')))
    SMALL.check_sequences(2, 3)
    SMALL.check_messages([{"role": "user", "content": "x" * 50}], max_model_len=512)
    SMALL.check_prompt("x" * 50, max_model_len=512)


def test_sequences_messages_prompt_chars_and_context() -> None:
    assert _param_of(SMALL.check_sequences, 1, 5) == "n"
    assert _param_of(SMALL.check_sequences, 7, 1) == "prompt"
    assert _param_of(SMALL.check_sequences, 3, 3) == "prompt"
    assert _param_of(SMALL.check_messages, [{"role": "user", "content": "x"}] * 4, 512) == "messages"
    assert _param_of(SMALL.check_messages, [{"role": "user", "content": "x" * 51}], 512) == "messages"
    assert _param_of(SMALL.check_prompt, "x" * 51, 512) == "prompt"
    assert _param_of(SMALL.check_prompt, "a\udfffb", 512) == "prompt"
    SMALL.check_prompt(list(range(1000)), 512)  # token ids: checked when tokenized
    # Without max_prompt_chars the bound is 64 characters per token of context.
    assert RequestLimits().prompt_char_limit(100) == 6400
    assert _param_of(RequestLimits().check_prompt, "x" * 6401, 100) == "prompt"
    assert _param_of(check_context, 10, 500, 0, 509) == "max_tokens"
    assert _param_of(check_context, 10, None, 500, 509) == "min_tokens"
    assert _param_of(check_context, 10, 500, 0, 509, "max_completion_tokens") == "max_completion_tokens"
    check_context(10, 499, 499, 509)


def test_limits_config_is_validated() -> None:
    for bad in ({"max_n": 0}, {"max_stop": True}, {"max_logprobs": 21}, {"grammar_compile_timeout": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            RequestLimits(**bad)


def test_regex_depth() -> None:
    assert regex_depth("abc") == 0
    assert regex_depth("(a(b)(c(d)))") == 3
    assert regex_depth(r"\(\(\((a)") == 1
    assert regex_depth("[(((]") == 0
    assert regex_depth('"(((("', grammar=True) == 0
    assert regex_depth('"(((("') == 4  # a regex has no string literals: quotes are characters


def test_sampling_params_refuse_non_finite_and_overflowing_values() -> None:
    for kw in (
        {"temperature": float("inf")},
        {"temperature": float("nan")},
        {"temperature": 101.0},
        {"repetition_penalty": 5e-324},
        {"repetition_penalty": float("inf")},
        {"top_p": float("nan")},
        {"presence_penalty": float("nan")},
        {"temperature": "hot"},
        {"logit_bias": {1: float("nan")}},
    ):
        with pytest.raises(ValueError, match=next(iter(kw))):
            SamplingParams(**kw)


# ---- the strict JSON body parser ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        (b'{"prompt": "\\ud800"}', "prompt", "U+D800"),
        (b'{"messages": [{"content": "ok \\udc00"}]}', "messages.0.content", "U+DC00"),
        (b'{"prompt": "\xff\xfe"}', "prompt", "byte 0xFF"),
        (b'{"logit_bias": {"\\ud83d": 1}}', "logit_bias", "a key of logit_bias"),
        (b'{"temperature": NaN}', "temperature", "NaN"),
        (b'{"top_p": -Infinity}', "top_p", "-Infinity"),
        (b'{"x": [1, 2, 1e400]}', "x.2", "inf"),
        (b'{"prompt": "a"', None, "not valid JSON"),
        (b"[" * 100_000 + b"]" * 100_000, None, "nested too deeply"),
        (b'{"n": ' + b"9" * 5000 + b"}", None, "not valid JSON"),
        (b"\xff{}", None, "not valid JSON"),
    ],
)
def test_bodies_that_are_not_json_text(body: bytes, param: str | None, words: str) -> None:
    with pytest.raises(BodyError) as info:
        parse_json_body(body)
    assert info.value.param == param
    assert words in str(info.value)


def test_valid_bodies_parse() -> None:
    text = (
        '{"prompt": "caf\\u00e9 \\ud83d\\ude00 😀", "n": 2, "t": 0.5, "deep": ' + "[" * 500 + "]" * 500 + "}"
    )
    value = parse_json_body(text.encode())
    assert value["prompt"] == "café 😀 😀" and value["n"] == 2


# ---- the offline LLM applies the same rules ---------------------------------------------------------
@pytest.fixture(scope="module")
def llm(tiny_llama_dir: str):
    from pagoda import LLM

    return LLM(tiny_llama_dir, dtype="float32", num_kv_blocks=64, limits=SMALL)


@pytest.mark.parametrize(
    ("prompt", "params", "param"),
    [
        ("hi", SamplingParams(n=5), "n"),
        ("hi", SamplingParams(logprobs=6), "logprobs"),
        ("hi", SamplingParams(stop=["a", "b", "c"]), "stop"),
        ("hi", SamplingParams(logit_bias={1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0}), "logit_bias"),
        (
            "hi",
            SamplingParams(structured_outputs=StructuredOutputs(regex="a" * 201)),
            "structured_outputs.regex",
        ),
        ("x" * 51, SamplingParams(), "prompt"),
        ("\ud800", SamplingParams(), "prompt"),
        ("hi", SamplingParams(max_tokens=512), "max_tokens"),  # no silent clamping to the context
        ("hi", SamplingParams(max_tokens=None, min_tokens=512), "min_tokens"),
        (
            "hi",
            SamplingParams(structured_outputs=StructuredOutputs(regex="(((((a)))))")),
            "structured_outputs.regex",
        ),
    ],
)
def test_offline_llm_applies_the_same_limits(llm, prompt: str, params: SamplingParams, param: str) -> None:
    with pytest.raises(LimitError) as info:
        llm.generate(prompt, params)
    assert info.value.param == param
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate("hi", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
    llm.engine.core.check_invariants()


# ---- the constraint built from a request's tools -----------------------------------------------------
def test_tools_are_bounded_like_any_constraint(tmp_path) -> None:
    from chat_families import build_family_model
    from fastapi.testclient import TestClient

    from pagoda.config import EngineArgs
    from pagoda.engine.llm_engine import LLMEngine
    from pagoda.entrypoints.openai.app import build_state, create_app
    from pagoda.entrypoints.server_args import ServerArgs

    model = build_family_model(tmp_path, "qwen25")
    limits = RequestLimits(max_grammar_chars=400)
    engine = LLMEngine(EngineArgs(model=model, dtype="float32", num_kv_blocks=512, limits=limits))
    state = build_state(engine, ServerArgs())
    ask = [{"role": "user", "content": "hi"}]

    def tool(parameters: dict) -> dict:
        return {"type": "function", "function": {"name": "f", "parameters": parameters}}

    try:
        with TestClient(create_app(state)) as client:
            big = {"type": "object", "properties": {f"p{i}": {"description": "x" * 50} for i in range(8)}}
            body = {"messages": ask, "tools": [tool(big)], "tool_choice": "required", "max_tokens": 4}
            error = client.post("/v1/chat/completions", json=body).json()["error"]
            assert error["param"] == "tools" and "--max-grammar-chars" in error["message"], error
            leak = {"type": "object", "properties": {"a": {"$ref": "file:///etc/passwd"}}}
            body = {"messages": ask, "tools": [tool(leak)], "tool_choice": "required", "max_tokens": 4}
            response = client.post("/v1/chat/completions", json=body)
            assert response.status_code == 400 and "never read from files" in response.text, response.text
            small = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
            body = {"messages": ask, "tools": [tool(small)], "tool_choice": "required", "max_tokens": 30}
            assert client.post("/v1/chat/completions", json=body).status_code == 200
    finally:
        state.engine.shutdown()
