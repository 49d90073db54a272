"""Structured output through the server: OpenAI's response_format and vLLM's guided_* /
structured_outputs fields, streaming and not, n > 1, and clear 400s."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

TIMEOUT = 60.0
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "visits": {"type": "integer", "minimum": 0}},
    "required": ["city", "visits"],
    "additionalProperties": False,
}


def test_guided_fields_on_completions(openai_client: openai.OpenAI, served_model: str) -> None:
    kw = dict(model=served_model, prompt="Answer:", max_tokens=200, temperature=1.0, seed=3, n=2)
    out = openai_client.completions.create(extra_body={"guided_json": SCHEMA}, **kw)
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.text), SCHEMA)
    out = openai_client.completions.create(extra_body={"guided_regex": r"[a-z]{3,6}-[0-9]{2}"}, **kw)
    assert all(re.fullmatch(r"[a-z]{3,6}-[0-9]{2}", c.text) for c in out.choices)
    out = openai_client.completions.create(extra_body={"guided_choice": ["north", "south"]}, **kw)
    assert all(c.text in ("north", "south") for c in out.choices)
    grammar = 'root ::= "<" [a-c]+ ">"'
    out = openai_client.completions.create(extra_body={"guided_grammar": grammar}, **kw)
    assert all(re.fullmatch(r"<[a-c]+>", c.text) for c in out.choices)
    out = openai_client.completions.create(extra_body={"structured_outputs": {"choice": ["yes", "no"]}}, **kw)
    assert all(c.text in ("yes", "no") for c in out.choices)


def test_streamed_structured_chat_equals_text(openai_client: openai.OpenAI, served_model: str) -> None:
    kw = dict(
        model=served_model,
        messages=[{"role": "user", "content": "A city?"}],
        max_tokens=200,
        temperature=0.8,
        seed=11,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}},
    )
    whole = openai_client.chat.completions.create(**kw).choices[0].message.content
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in openai_client.chat.completions.create(stream=True, **kw)
        if c.choices
    )
    assert streamed == whole
    jsonschema.validate(json.loads(whole), SCHEMA)


@pytest.mark.parametrize(
    "extra,named",
    [
        ({"guided_regex": "[a-"}, "regex"),
        ({"guided_json": {"type": "nonsense"}}, "json"),
        ({"guided_grammar": "root ::= "}, "grammar"),
        ({"guided_choice": []}, "choice"),
        ({"guided_choice": ["a"], "guided_regex": "a"}, "only one"),
    ],
)
def test_bad_constraints_are_400s(pagoda_server: str, served_model: str, extra: dict, named: str) -> None:
    body = {"model": served_model, "prompt": "x", "max_tokens": 4, **extra}
    r = httpx.post(pagoda_server + "/v1/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["message"]
    assert named in error["message"]
    # the server keeps serving
    ok = httpx.post(
        pagoda_server + "/v1/completions",
        json={"model": served_model, "prompt": "x", "max_tokens": 2},
        timeout=TIMEOUT,
    )
    assert ok.status_code == 200


def test_reset_prefix_cache_endpoint(pagoda_server: str, served_model: str) -> None:
    body = {
        "model": served_model,
        "prompt": "a shared prefix that is long enough to fill blocks " * 4,
        "max_tokens": 2,
    }
    assert httpx.post(pagoda_server + "/v1/completions", json=body, timeout=TIMEOUT).status_code == 200
    r = httpx.post(pagoda_server + "/reset_prefix_cache", timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["freed_blocks"] > 0
