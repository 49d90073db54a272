"""OpenAI's `prediction` field over HTTP, through the official `openai` client: the same output with
and without it, `usage.completion_tokens_details` accepted / rejected prediction tokens (streamed
usage too), on /v1/chat/completions and /v1/completions; 400s for bad shapes and sizes."""

from __future__ import annotations

import httpx
import openai
import pytest

TIMEOUT = 60.0
GREEDY = {"temperature": 0.0, "max_tokens": 24, "extra_body": {"ignore_eos": True}}


def _details(usage) -> tuple[int, int]:
    d = usage.completion_tokens_details
    return d.accepted_prediction_tokens, d.rejected_prediction_tokens


def test_chat_prediction(openai_client: openai.OpenAI, served_model: str) -> None:
    messages = [{"role": "user", "content": "Rewrite: hello world"}]
    plain = openai_client.chat.completions.create(model=served_model, messages=messages, **GREEDY)
    assert plain.usage.completion_tokens_details is None
    text = plain.choices[0].message.content
    for prediction in (
        {"type": "content", "content": text},
        {
            "type": "content",
            "content": [{"type": "text", "text": text[:5]}, {"type": "text", "text": text[5:]}],
        },
    ):
        out = openai_client.chat.completions.create(
            model=served_model, messages=messages, prediction=prediction, **GREEDY
        )
        assert out.choices[0].message.content == text
        # (The tiny model's text need not tokenize back to its tokens: counts > 0 are shown on
        # /v1/completions below and exactly in test_prediction.py.)
        accepted, rejected = _details(out.usage)
        assert 0 <= accepted <= out.usage.completion_tokens and rejected >= 0
    chunks = list(
        openai_client.chat.completions.create(
            model=served_model,
            messages=messages,
            prediction={"type": "content", "content": text},
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert _details(chunks[-1].usage) == _details(out.usage)


def test_completions_prediction_with_n(openai_client: openai.OpenAI, served_model: str) -> None:
    kw = {"model": served_model, "prompt": "Say it:", "n": 2, "seed": 3, "temperature": 0.7, "max_tokens": 24}
    plain = openai_client.completions.create(**kw)
    prediction = {"type": "content", "content": plain.choices[0].text}
    out = openai_client.completions.create(**kw, extra_body={"prediction": prediction})
    assert [c.text for c in out.choices] == [c.text for c in plain.choices]
    accepted, rejected = _details(out.usage)
    assert accepted + rejected > 0
    chunks = list(
        openai_client.completions.create(
            **kw, stream=True, stream_options={"include_usage": True}, extra_body={"prediction": prediction}
        )
    )
    assert _details(chunks[-1].usage) == (accepted, rejected)


@pytest.mark.parametrize(
    "prediction, where",
    [
        ({"type": "text", "content": "x"}, "type"),
        ({"type": "content"}, "content"),
        ({"type": "content", "content": 5}, "content"),
        ({"type": "content", "content": [{"type": "image_url", "text": "x"}]}, "type"),
        ({"type": "content", "content": "x", "extra": 1}, "extra"),
        ("just text", "prediction"),
    ],
)
def test_bad_prediction_shapes_are_400(pagoda_server: str, served_model: str, prediction, where: str) -> None:
    for path, body in (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"prompt": "hi"}),
    ):
        r = httpx.post(
            pagoda_server + path,
            json={"model": served_model, **body, "prediction": prediction},
            timeout=TIMEOUT,
        )
        assert r.status_code == 400, r.text
        assert where in r.text


def test_prediction_over_the_limit_is_400(pagoda_server: str, served_model: str) -> None:
    big = {"type": "content", "content": "x" * 262145}
    r = httpx.post(
        pagoda_server + "/v1/completions",
        json={"model": served_model, "prompt": "hi", "prediction": big},
        timeout=TIMEOUT,
    )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "prediction" and "--max-prediction-chars" in r.text
