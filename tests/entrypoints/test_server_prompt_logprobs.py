"""Prompt logprobs over HTTP, against transformers' fp32 logits: vLLM's `prompt_logprobs` field
on /v1/completions and /v1/chat/completions, legacy `echo` + `logprobs` (the first entry null),
`echo` with `max_tokens: 0`, pagoda's `logprob_start_len`, and the errors."""

from __future__ import annotations

import functools
import json

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

TIMEOUT = 60.0
TOL = 1e-4


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: str):
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()

    @functools.cache
    def logprobs(prompt: tuple[int, ...]) -> torch.Tensor:
        with torch.inference_mode():
            return torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)

    return logprobs


def _post(base: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(base + path, json=body, timeout=TIMEOUT)


def _tokens(base: str, model: str, **body) -> list[int]:
    return _post(base, "/tokenize", {"model": model, **body}).json()["tokens"]


def check_vllm_entries(reference, prompt: list[int], entries: list, k: int, start: int = 1) -> None:
    ref = reference(tuple(prompt))
    assert len(entries) == len(prompt)
    assert all(e is None for e in entries[:start])
    for i in range(start, len(prompt)):
        entry = {int(t): v for t, v in entries[i].items()}
        got = entry[prompt[i]]
        assert abs(got["logprob"] - ref[i - 1, prompt[i]].item()) < TOL
        assert set(got) == {"logprob", "rank", "decoded_token"}
        ranked = sorted((v["rank"], v["logprob"]) for v in entry.values() if v["rank"] <= k)
        assert [r for r, _ in ranked] == list(range(1, k + 1))
        for (_, lp), v in zip(ranked, ref[i - 1].topk(k).values.tolist(), strict=True):
            assert abs(lp - v) < TOL


def test_completions_prompt_logprobs(pagoda_server, served_model, reference):
    prompt = "The quick brown fox jumps over the lazy dog"
    ids = _tokens(pagoda_server, served_model, prompt=prompt)
    body = {"model": served_model, "prompt": prompt, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2}
    data = _post(pagoda_server, "/v1/completions", body).json()
    (choice,) = data["choices"]
    check_vllm_entries(reference, ids, choice["prompt_logprobs"], 2)
    assert choice["logprobs"] is None and data["usage"]["completion_tokens"] == 2
    # Several prompts as token ids, and a start position: the prefix before it is a cache hit.
    prompts = [ids, ids[:5] + [7, 8, 9]]
    body = {**body, "prompt": prompts, "prompt_logprobs": 0, "logprob_start_len": 4}
    data = _post(pagoda_server, "/v1/completions", body).json()
    for choice in sorted(data["choices"], key=lambda c: c["index"]):
        check_vllm_entries(reference, prompts[choice["index"]], choice["prompt_logprobs"], 0, start=4)


def test_echo_with_logprobs(pagoda_server, openai_client, served_model, reference):
    client = openai_client
    prompt = "Hello there, general"
    ids = _tokens(pagoda_server, served_model, prompt=prompt)
    ref = reference(tuple(ids))
    for max_tokens in (3, 0):
        out = client.completions.create(
            model=served_model, prompt=prompt, max_tokens=max_tokens, temperature=0, echo=True, logprobs=1
        )
        (choice,) = out.choices
        lp = choice.logprobs
        assert choice.text.startswith(prompt)
        assert len(lp.tokens) == len(ids) + max_tokens
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for i in range(1, len(ids)):
            assert abs(lp.token_logprobs[i] - ref[i - 1, ids[i]].item()) < TOL
            assert len(lp.top_logprobs[i]) in (1, 2)
        assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
        if max_tokens == 0:  # the prompt alone, as vLLM does
            assert choice.text == prompt and out.usage.completion_tokens == 0
            assert choice.finish_reason == "length"
    # Streamed: the first chunk carries the echoed prompt and its logprobs.
    chunks = list(
        client.completions.create(
            model=served_model, prompt=prompt, max_tokens=2, temperature=0, echo=True, logprobs=0, stream=True
        )
    )
    first = chunks[0].choices[0]
    assert first.text.startswith(prompt)
    assert first.logprobs.token_logprobs[0] is None
    streamed = [x for c in chunks for x in c.choices[0].logprobs.token_logprobs]
    assert len(streamed) == len(ids) + 2
    assert all(abs(streamed[i] - ref[i - 1, ids[i]].item()) < TOL for i in range(1, len(ids)))


def test_chat_prompt_logprobs(pagoda_server, served_model, reference):
    messages = [{"role": "user", "content": "Hi, how are you?"}]
    ids = _tokens(pagoda_server, served_model, messages=messages)
    body = {
        "model": served_model,
        "messages": messages,
        "max_tokens": 1,
        "temperature": 0,
        "prompt_logprobs": 1,
    }
    data = _post(pagoda_server, "/v1/chat/completions", body).json()
    check_vllm_entries(reference, ids, data["prompt_logprobs"], 1)


@pytest.mark.parametrize(
    "path, extra, param",
    [
        ("/v1/completions", {"prompt_logprobs": 0, "stream": True}, "prompt_logprobs"),
        ("/v1/completions", {"prompt_logprobs": 21}, "prompt_logprobs"),
        ("/v1/completions", {"prompt_logprobs": -1}, "prompt_logprobs"),
        ("/v1/completions", {"logprob_start_len": 1}, "logprob_start_len"),
        ("/v1/completions", {"prompt_logprobs": 0, "logprob_start_len": 500}, "logprob_start_len"),
        ("/v1/completions", {"max_tokens": -1}, "max_tokens"),
        ("/v1/chat/completions", {"max_tokens": 0}, "max_tokens"),
        ("/v1/chat/completions", {"prompt_logprobs": 0, "stream": True}, "prompt_logprobs"),
        ("/v1/chat/completions", {"prompt_logprobs": 0, "logprob_start_len": 500}, "logprob_start_len"),
    ],
)
def test_errors_name_the_field(pagoda_server, served_model, path, extra, param):
    body = {"model": served_model, "max_tokens": 1, **extra}
    if path == "/v1/completions":
        body["prompt"] = "Hello"
    else:
        body["messages"] = [{"role": "user", "content": "Hello"}]
    response = _post(pagoda_server, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, json.dumps(error)


def test_completions_return_token_ids(pagoda_server, served_model):
    """vLLM's return_token_ids: each choice carries its prompt's token ids and its output's; in a
    stream the prompt's come with the choice's first chunk, each chunk with its new tokens."""
    prompts = ["the river", "a stone light"]
    body = {"model": served_model, "prompt": prompts, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    plain = _post(pagoda_server, "/v1/completions", body).json()["choices"]
    assert all(c["prompt_token_ids"] is None and c["token_ids"] is None for c in plain)
    choices = _post(pagoda_server, "/v1/completions", {**body, "return_token_ids": True}).json()["choices"]
    outputs = {}
    for c in choices:
        assert c["prompt_token_ids"] == _tokens(pagoda_server, served_model, prompt=prompts[c["index"]])
        assert len(c["token_ids"]) == 3
        outputs[c["index"]] = c["token_ids"]
    streamed: dict[int, list[int]] = {0: [], 1: []}
    firsts: dict[int, list[int]] = {}
    with httpx.stream(
        "POST",
        pagoda_server + "/v1/completions",
        json={**body, "return_token_ids": True, "stream": True},
        timeout=TIMEOUT,
    ) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:])["choices"]:
                if c["prompt_token_ids"] is not None:
                    assert c["index"] not in firsts  # only in the choice's first chunk
                    firsts[c["index"]] = c["prompt_token_ids"]
                streamed[c["index"]] += c["token_ids"]
    assert firsts == {c["index"]: c["prompt_token_ids"] for c in choices}
    assert streamed == outputs
    # echo with max_tokens 0: the prompt's ids, no output ids
    echo = {
        "model": served_model,
        "prompt": prompts[0],
        "max_tokens": 0,
        "echo": True,
        "return_token_ids": True,
    }
    (c,) = _post(pagoda_server, "/v1/completions", echo).json()["choices"]
    assert (
        c["prompt_token_ids"] == _tokens(pagoda_server, served_model, prompt=prompts[0])
        and c["token_ids"] == []
    )
    bad = _post(pagoda_server, "/v1/completions", {**body, "return_token_ids": "yes"})
    assert bad.status_code == 400 and "return_token_ids" in bad.text


def test_completions_prompt_only(pagoda_server, served_model, reference):
    """max_tokens 0 without echo: vLLM's prompt_logprobs of the prompt alone, or the prompt put in
    the prefix cache (the next request's hit); streamed with echo: one chunk, the prompt."""
    prompt = "A prompt that only goes into the cache, nothing generated after it."
    ids = _tokens(pagoda_server, served_model, prompt=prompt)
    body = {"model": served_model, "prompt": prompt, "max_tokens": 0}
    scored = _post(pagoda_server, "/v1/completions", {**body, "prompt_logprobs": 1}).json()
    (choice,) = scored["choices"]
    assert choice["text"] == "" and choice["finish_reason"] == "length" and choice["logprobs"] is None
    assert scored["usage"]["completion_tokens"] == 0 and scored["usage"]["prompt_tokens"] == len(ids)
    check_vllm_entries(reference, ids, choice["prompt_logprobs"], 1)
    longer = prompt + " And then more."
    _post(pagoda_server, "/reset_prefix_cache", {})
    plain = _post(pagoda_server, "/v1/completions", {**body, "prompt": longer}).json()
    assert plain["choices"][0]["prompt_logprobs"] is None and plain["usage"]["completion_tokens"] == 0
    again = _post(pagoda_server, "/v1/completions", {**body, "prompt": longer, "max_tokens": 2}).json()
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    # all of it but the last token, whose logits the sampled token needs
    assert cached == again["usage"]["prompt_tokens"] - 1
    with httpx.stream(
        "POST",
        pagoda_server + "/v1/completions",
        json={**body, "echo": True, "stream": True},
        timeout=TIMEOUT,
    ) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    (chunk,) = chunks
    assert chunk["choices"][0]["text"] == prompt and chunk["choices"][0]["finish_reason"] == "length"
