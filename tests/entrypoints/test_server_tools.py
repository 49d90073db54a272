"""The chat API agents use, end to end through the official `openai` client: tool calling in each
family's format (Qwen hermes, Qwen3-Coder XML, Llama 3.1 JSON, Mistral v0.3 and v11) on tiny
random models, reasoning, chat template keywords, multi-turn histories with tool results, and the
400s. A random-weight model knows nothing of tools, so calls come from the grammar alone."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from chat_families import RENDERED, family_models

from pagoda.tokenizer import load_tokenizer

pytestmark = pytest.mark.timeout(300)
TIMEOUT = 120.0

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 5},
        "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
}
FORECAST = {  # string parameters are free text in the XML format: this one has none
    "type": "object",
    "properties": {"unit": {"enum": ["c", "f"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["unit", "days"],
}
CLOCK = {"type": "object", "properties": {"tz": {"enum": ["utc", "cet"]}}, "required": ["tz"]}


def _tools(family: str) -> list[dict]:
    first = ("get_forecast", FORECAST) if family == "qwen3_coder" else ("get_weather", WEATHER)
    return [
        {"type": "function", "function": {"name": name, "description": f"{name} tool", "parameters": schema}}
        for name, schema in (first, ("get_time", CLOCK))
    ]


SCHEMAS = {"get_weather": WEATHER, "get_forecast": FORECAST, "get_time": CLOCK}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL_FAMILIES = ["qwen25", "qwen3_coder", "llama31", "mistral_v03", "mistral_v11"]


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory: pytest.TempPathFactory):
    return family_models(tmp_path_factory.mktemp("families"))


@pytest.fixture(scope="module")
def server(family_dirs, pagoda_server_factory):
    """`server(family, **flags) -> base_url`, one server per (family, flags), started on first use."""
    started: dict[tuple, str] = {}

    def get(family: str, **flags) -> str:
        key = (family, tuple(sorted(flags.items())))
        if key not in started:
            started[key] = pagoda_server_factory(family_dirs(family), max_model_len=4096, **flags)
        return started[key]

    return get


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)


def _model(base: str) -> str:
    return httpx.get(base + "/v1/models", timeout=TIMEOUT).json()["data"][0]["id"]


def _create(base: str, **kw):
    return _client(base).chat.completions.create(model=_model(base), **kw)


def _streamed(base: str, **kw) -> dict[int, dict]:
    """Per choice: content, reasoning, calls [(id, name, arguments)] and finish reason, from the
    stream's deltas; checks OpenAI's delta form on the way."""
    out: dict[int, dict] = {}
    for chunk in _create(base, stream=True, **kw):
        for choice in chunk.choices:
            c = out.setdefault(choice.index, {"content": "", "reasoning": "", "calls": {}, "finish": None})
            delta = choice.delta
            c["content"] += delta.content or ""
            c["reasoning"] += getattr(delta, "reasoning_content", None) or ""
            for tc in delta.tool_calls or []:
                if tc.index not in c["calls"]:
                    assert (
                        tc.index == len(c["calls"]) and tc.id and tc.type == "function" and tc.function.name
                    )
                    c["calls"][tc.index] = [tc.id, tc.function.name, ""]
                else:
                    assert tc.id is None and tc.function.name is None
                c["calls"][tc.index][2] += tc.function.arguments or ""
            if choice.finish_reason is not None:
                c["finish"] = choice.finish_reason
    for c in out.values():
        c["calls"] = [tuple(v) for _, v in sorted(c["calls"].items())]
    return out


def _whole(base: str, **kw) -> dict[int, dict]:
    """The same per-choice summary from a non-streamed reply."""
    reply = _create(base, **kw)
    return {
        choice.index: {
            "content": choice.message.content or "",
            "reasoning": getattr(choice.message, "reasoning_content", None) or "",
            "calls": [
                (tc.id, tc.function.name, tc.function.arguments) for tc in choice.message.tool_calls or []
            ],
            "finish": choice.finish_reason,
        }
        for choice in reply.choices
    }


def _check_calls(choice: dict, names: set[str]) -> None:
    assert choice["calls"], choice
    for _, name, arguments in choice["calls"]:
        assert name in names
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def _without_ids(choices: dict[int, dict]) -> dict[int, dict]:
    return {i: {**c, "calls": [call[1:] for call in c["calls"]]} for i, c in choices.items()}


# ---- tool_choice required / named: the grammar makes every call valid --------------------------------
@pytest.mark.parametrize("family", CALL_FAMILIES)
@pytest.mark.parametrize("stream", [False, True])
def test_required_and_named_calls_validate(server, family: str, stream: bool) -> None:
    base = server(family)
    tools = _tools(family)
    names = {t["function"]["name"] for t in tools}
    get = _streamed if stream else _whole
    kw = dict(messages=ASK, tools=tools, temperature=1.0, max_tokens=300, n=8)
    for seed, parallel in ((1, False), (2, True)):
        for choice in get(
            base, tool_choice="required", parallel_tool_calls=parallel, seed=seed, **kw
        ).values():
            if parallel and choice["finish"] == "length":
                choice["calls"] = choice["calls"][:-1] or choice["calls"]  # the last may be cut off
            else:
                assert choice["finish"] == "tool_calls" and choice["content"] == ""
                if not parallel:
                    assert len(choice["calls"]) == 1
            _check_calls(choice, names)
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice in get(base, tool_choice=named, seed=3, **kw).values():
        assert choice["finish"] == "stop" and choice["content"] == "" and len(choice["calls"]) == 1
        _check_calls(choice, {"get_time"})


@pytest.mark.parametrize("family", CALL_FAMILIES)
def test_streamed_calls_equal_non_streamed(server, family: str) -> None:
    base = server(family)
    for choice in (
        "required",
        {"type": "function", "function": {"name": _tools(family)[0]["function"]["name"]}},
    ):
        kw = dict(messages=ASK, tools=_tools(family), tool_choice=choice, temperature=0.0, max_tokens=300)
        whole, streamed = _whole(base, **kw), _streamed(base, **kw)
        assert _without_ids(whole) == _without_ids(streamed)
        assert whole[0]["calls"]
        if family.startswith("mistral"):
            assert all(len(c[0]) == 9 and c[0].isalnum() for c in whole[0]["calls"] + streamed[0]["calls"])


@pytest.mark.parametrize("family", CALL_FAMILIES)
def test_history_with_tool_results_round_trips(server, family: str) -> None:
    """The calls the server returns and a tool result go back as history: the template renders them
    in the family's format, and the next turn is served."""
    base = server(family)
    tools = _tools(family)
    named = {"type": "function", "function": {"name": "get_time"}}
    reply = _create(base, messages=ASK, tools=tools, tool_choice=named, temperature=0.0, max_tokens=100)
    (call,) = reply.choices[0].message.tool_calls
    call.function.arguments = json.dumps({"tz": "utc"})  # a known value to look for
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "22C"},
    ]
    ids = httpx.post(base + "/tokenize", json={"messages": history, "tools": tools}, timeout=TIMEOUT).json()[
        "tokens"
    ]
    rendered = load_tokenizer(_model(base)).decode(ids, skip_special_tokens=False)
    call_text, result_text = RENDERED[family]
    assert call_text in rendered and result_text in rendered
    if family == "mistral_v03":
        assert f'"id": "{call.id}"' in rendered and f'"call_id": "{call.id}"' in rendered
    assert rendered.index(call_text) < rendered.index(result_text)
    follow = _create(base, messages=history, tools=tools, temperature=0.0, max_tokens=8)
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # Clients append the reply's message object itself.
    again = _create(base, messages=[*ASK, reply.choices[0].message, history[-1]], tools=tools, max_tokens=4)
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")
    as_dict = {**reply.choices[0].message.model_dump(), "tool_calls": [call.model_dump()]}
    assert {"refusal", "audio", "function_call", "annotations"} <= set(as_dict)
    again = _create(base, messages=[*ASK, as_dict, history[-1]], tools=tools, max_tokens=4)
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_foreign_call_ids_are_mapped_for_mistral(server) -> None:
    base = server("mistral_v03")
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_0123456789abcdefghij",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": '{"tz": "cet"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_0123456789abcdefghij", "content": "noon"},
    ]
    out = _create(base, messages=history, tools=_tools("mistral_v03"), temperature=0.0, max_tokens=4)
    assert out.choices[0].finish_reason in ("stop", "length")


# ---- tool_choice auto and none -----------------------------------------------------------------------
def test_auto_and_none(server) -> None:
    base = server("qwen25")
    tokenizer = load_tokenizer(_model(base))
    tool_call = tokenizer.convert_tokens_to_ids("<tool_call>")
    strict = [{**t, "function": {**t["function"], "strict": True}} for t in _tools("qwen25")]
    kw = dict(messages=ASK, temperature=1.0, max_tokens=40, n=4, seed=5)
    # auto, strict tools: free text unless a call starts; whatever calls there are validate.
    for parallel in (True, False):
        for choice in _whole(
            base, tools=strict, tool_choice="auto", parallel_tool_calls=parallel, **kw
        ).values():
            assert choice["finish"] == ("tool_calls" if choice["calls"] else choice["finish"])
            assert choice["finish"] in ("stop", "length", "tool_calls")
            for _, name, arguments in choice["calls"]:
                jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    # none: never calls, even when the model writes call markers.
    bias = {str(tool_call): 8.0}
    for get in (_whole, _streamed):
        for choice in get(base, tools=strict, tool_choice="none", logit_bias=bias, **kw).values():
            assert choice["calls"] == [] and "<tool_call>" in choice["content"]
            assert choice["finish"] in ("stop", "length")


def test_user_constraint_with_auto_is_parsed_for_calls(server) -> None:
    """A user's constraint combines with auto (its text is parsed for calls) and with none."""
    base = server("qwen25")
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": CLOCK}}
    kw = dict(messages=ASK, tools=_tools("qwen25"), temperature=1.0, max_tokens=80, seed=2)
    call = '<tool_call>\\n\\{"name": "get_time", "arguments": \\{"tz": "(utc|cet)"\\}\\}\\n</tool_call>'
    regex = {"structured_outputs": {"regex": "Checking\\. " + call}}
    for get in (_whole, _streamed):
        (choice,) = get(base, tool_choice="auto", response_format=fmt, **kw).values()
        assert choice["calls"] == [] and choice["finish"] == "stop"
        jsonschema.validate(json.loads(choice["content"]), CLOCK)
        (choice,) = get(base, tool_choice="auto", extra_body=regex, **kw).values()
        assert choice["content"] == "Checking." and choice["finish"] == "tool_calls"
        _check_calls(choice, {"get_time"})
        (choice,) = get(base, tool_choice="none", extra_body=regex, **kw).values()
        assert choice["calls"] == [] and choice["content"].startswith("Checking. <tool_call>")


# ---- reasoning ---------------------------------------------------------------------------------------
def _think_bias(base: str, weight: float) -> dict[str, float]:
    return {str(load_tokenizer(_model(base)).convert_tokens_to_ids("</think>")): weight}


def test_reasoning_opened_by_the_prompt(server) -> None:
    """The template opens <think> in the prompt: the reply starts in the thought."""
    base = server("qwen3_thinking")
    kw = dict(messages=ASK, temperature=1.0, max_tokens=60, logit_bias=_think_bias(base, 3.0), n=4, seed=4)
    whole, streamed = _whole(base, **kw), _streamed(base, **kw)
    assert whole == streamed
    assert any(c["reasoning"] and c["content"] for c in whole.values())
    reply = _create(base, **kw).choices
    assert all(c.message.reasoning == c.message.reasoning_content for c in reply)
    # Constraints apply to the answer, after the thought: tools and response_format.
    kw["max_tokens"] = 300
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": CLOCK}}
    for get in (_whole, _streamed):
        choices = get(base, tools=_tools("qwen3"), tool_choice="required", parallel_tool_calls=False, **kw)
        assert any(c["reasoning"] for c in choices.values())
        for choice in choices.values():
            assert choice["finish"] == "tool_calls" and choice["content"] == ""
            _check_calls(choice, {"get_weather", "get_time"})
        choices = get(base, response_format=fmt, **kw)
        assert any(c["reasoning"] for c in choices.values())
        for choice in choices.values():
            assert choice["finish"] == "stop"
            jsonschema.validate(json.loads(choice["content"]), CLOCK)


def test_reasoning_switched_by_chat_template_kwargs(server) -> None:
    """Qwen3's enable_thinking, as the server's default and per request (the request wins)."""
    base = server("qwen3", default_chat_template_kwargs=json.dumps({"enable_thinking": False}))
    tokens = httpx.post(base + "/tokenize", json={"messages": ASK}, timeout=TIMEOUT).json()["tokens"]
    tokenizer = load_tokenizer(_model(base))
    assert tokenizer.decode(tokens).endswith("<think>\n\n</think>\n\n")
    # <think> and </think> made likely, so that some samples open a thought and close it.
    bias = {str(tokenizer.convert_tokens_to_ids("<think>")): 5.0, **_think_bias(base, 4.0)}
    kw = dict(messages=ASK, temperature=1.0, max_tokens=60, logit_bias=bias, n=4)
    found_off = found_on = False
    for seed in range(8):
        off = _whole(base, seed=seed, **kw)  # thinking is off: what the model writes is content
        assert all(c["reasoning"] == "" for c in off.values())
        found_off |= any(c["content"].startswith("<think>") for c in off.values())
        on = dict(kw, seed=seed, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
        whole = _whole(base, **on)
        assert whole == _streamed(base, **on)
        found_on |= any(c["reasoning"] and c["content"] for c in whole.values())
        if found_off and found_on:
            break
    assert found_off and found_on
    # Reasoning in the history comes back under either name.
    for key in ("reasoning_content", "reasoning"):
        history = [
            *ASK,
            {"role": "assistant", "content": "Sunny.", key: "Looked it up."},
            {"role": "user", "content": "Thanks"},
        ]
        ids = httpx.post(base + "/tokenize", json={"messages": history}, timeout=TIMEOUT).json()["tokens"]
        assert "<think>\nLooked it up.\n</think>\n\nSunny." in tokenizer.decode(ids)


# ---- the rest of the surface -------------------------------------------------------------------------
def test_models_by_id_and_version(server) -> None:
    base = server("qwen25")
    model = _model(base)
    card = httpx.get(f"{base}/v1/models/{model}", timeout=TIMEOUT)
    assert card.status_code == 200 and card.json()["id"] == model and card.json()["object"] == "model"
    assert _client(base).models.retrieve(model).id == model
    missing = httpx.get(f"{base}/v1/models/nope", timeout=TIMEOUT)
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
    version = httpx.get(base + "/version", timeout=TIMEOUT).json()
    assert isinstance(version["version"], str) and version["version"]


def test_continue_final_message_and_documents(server) -> None:
    base = server("qwen25")
    tokenizer = load_tokenizer(_model(base))
    history = [*ASK, {"role": "assistant", "content": "It is"}]
    body = {"messages": history, "add_generation_prompt": False, "continue_final_message": True}
    tokens = httpx.post(base + "/tokenize", json=body, timeout=TIMEOUT).json()["tokens"]
    assert tokenizer.decode(tokens).endswith("<|im_start|>assistant\nIt is")
    extra = {"add_generation_prompt": False, "continue_final_message": True}
    out = _create(base, messages=history, temperature=0.0, max_tokens=4, extra_body=extra)
    assert out.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]},
            "tools.0.function.parameters",
        ),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}] * 2}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "tool_choice",
        ),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "tool_choice",
        ),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"chat_template_kwargs": {"no_such_variable": 1}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
        ({"documents": [{"title": "a", "text": "b"}]}, "documents"),
        ({"continue_final_message": True}, "continue_final_message"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": "required",
                "min_tokens": 2,
            },
            "min_tokens",
        ),
        (
            {
                "messages": [
                    *ASK,
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{bad"}}
                        ],
                    },
                ]
            },
            "messages.1.tool_calls.0.function.arguments",
        ),
        ({"messages": [*ASK, {"role": "tool", "content": "x"}]}, "messages.1"),
        ({"messages": [*ASK, {"role": "user", "content": "x", "tool_calls": []}]}, "messages.1"),
    ],
)
def test_bad_requests_are_400s(server, body: dict, param: str) -> None:
    base = server("qwen25")
    response = httpx.post(base + "/v1/chat/completions", json={"messages": ASK, **body}, timeout=TIMEOUT)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text


def test_unknown_format_renders_tools_but_refuses_required(family_dirs) -> None:
    """No parser for the template's format: the server says so at start, renders tools, parses no
    calls and refuses tool choices it cannot enforce."""
    from server_utils import start_server

    process = start_server(family_dirs("qwen25"), dtype="float32", num_kv_blocks=64, tool_call_parser="none")
    try:
        _check_unknown_format(process.base_url)
        assert "calls come back as content" in process.log()
    finally:
        assert process.stop() == 0


def _check_unknown_format(base: str) -> None:
    tools = _tools("qwen25")
    out = _whole(base, messages=ASK, tools=tools, temperature=0.0, max_tokens=8)
    assert out[0]["calls"] == []
    refused = httpx.post(
        base + "/v1/chat/completions",
        json={"messages": ASK, "tools": tools, "tool_choice": "required"},
        timeout=TIMEOUT,
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tool_choice"
    assert "--tool-call-parser" in refused.json()["error"]["message"]
