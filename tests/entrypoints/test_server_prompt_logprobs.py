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

from server_utils import wait_idle

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
        ("/v1/completions", {"logprob_start_char": 2}, "logprob_start_char"),
        ("/v1/completions", {"prompt_logprobs": 0, "logprob_start_char": -1}, "logprob_start_char"),
        ("/v1/completions", {"prompt_logprobs": 0, "logprob_start_char": 6}, "logprob_start_char"),
        ("/v1/completions", {"prompt_logprobs": 0, "logprob_start_char": "2"}, "logprob_start_char"),
        (
            "/v1/completions",
            {"prompt_logprobs": 0, "logprob_start_char": 2, "logprob_start_len": 1},
            "logprob_start_char",
        ),
        ("/v1/chat/completions", {"prompt_logprobs": 0, "logprob_start_char": 2}, "logprob_start_char"),
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
    assert "prompt_logprobs_start" not in choice  # logprob_start_char's alone
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


def _spans(base: str, model: str, head: str, texts: list[str]) -> list[tuple[list[int], int]]:
    """Each text's token ids and where logprob_start_char=len(head) starts its span: its first
    token that differs from head's own, at least 1 and at most its last."""
    head_ids = _tokens(base, model, prompt=head)
    out = []
    for text in texts:
        ids = _tokens(base, model, prompt=text)
        shared = 0
        while shared < min(len(ids), len(head_ids)) and ids[shared] == head_ids[shared]:
            shared += 1
        out.append((ids, max(1, min(shared, len(ids) - 1))))
    return out


def _scored(base: str, body: dict) -> list[tuple[int, list[int], list[float]]]:
    data = _post(base, "/v1/completions", body)
    assert data.status_code == 200, data.text
    result = []
    for choice in sorted(data.json()["choices"], key=lambda c: c["index"]):
        entries = choice["prompt_logprobs"]
        assert all(len(e) == 1 for e in entries)  # prompt_logprobs 0: the scored token alone
        ids = [int(next(iter(e))) for e in entries]
        result.append(
            (choice["prompt_logprobs_start"], ids, [next(iter(e.values()))["logprob"] for e in entries])
        )
    return result


# "...: th" + "e" re-tokenizes the head's end (the tokenizer merges " the"); "" and "e" leave the
# text no longer than the head's tokens (the span is the last token).
@pytest.mark.parametrize(
    "head, tails",
    [
        ("Review: the soup was cold\nSentiment:", [" positive", " positively", " negative", "x"]),
        ("Sentiment: th", ["e whole story", "ink so", ""]),
        # every continuation starts with the same tokens: the head request scores them
        ("Review: the soup was cold\nSentiment:", [" positive", " positively", " pos"]),
    ],
)
def test_completions_logprob_start_char(pagoda_server, served_model, reference, head, tails):
    """logprob_start_char scores each prompt from its first token that differs from the head's
    own and answers with that span only; the one-pass scoring (max_tokens 0, prompt_logprobs 0)
    and the general path (here: max_tokens 1) give transformers' logprobs on the same spans."""
    texts = [head + t for t in tails]
    spans = _spans(pagoda_server, served_model, head, texts)
    body = {
        "model": served_model,
        "prompt": texts,
        "max_tokens": 0,
        "prompt_logprobs": 0,
        "logprob_start_char": len(head),
    }
    _post(pagoda_server, "/reset_prefix_cache", {})
    one_pass = _scored(pagoda_server, body)
    general = _scored(pagoda_server, {**body, "max_tokens": 1, "temperature": 0})
    for (ids, start), a, b in zip(spans, one_pass, general, strict=True):
        ref = reference(tuple(ids))
        want = [ref[i - 1, ids[i]].item() for i in range(start, len(ids))]
        for got_start, got_ids, got in (a, b):
            assert got_start == start and got_ids == ids[start:]
            assert got == pytest.approx(want, abs=TOL)


def test_logprob_start_char_computes_each_row_once(pagoda_server, served_model):
    """The one-pass scoring computes the head's uncached tokens and the tokens every continuation
    starts with once, then each continuation's other tokens but its last (whose KV and logits
    nobody reads); usage counts the rest as cached."""
    head = "Question: is the river water, or is it stone?\nAnswer:"
    tails = [" yes", " yes it is", " yesterday", " yes sir"]
    texts = [head + t for t in tails]
    spans = _spans(pagoda_server, served_model, head, texts)
    n = len(_tokens(pagoda_server, served_model, prompt=head))
    assert all(start == n for _, start in spans)
    _post(pagoda_server, "/reset_prefix_cache", {})
    before = wait_idle(pagoda_server)
    body = {"model": served_model, "prompt": texts, "max_tokens": 0, "prompt_logprobs": 0}
    data = _post(pagoda_server, "/v1/completions", {**body, "logprob_start_char": len(head)}).json()
    after = wait_idle(pagoda_server)
    computed = (after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"]) - (
        after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]
    )
    lead = 0  # the tokens every continuation starts with (leaving each one of its own)
    while lead < min(len(ids) for ids, _ in spans) - n - 1 and len({ids[n + lead] for ids, _ in spans}) == 1:
        lead += 1
    assert lead >= 1  # the head request scores those
    h = n + lead
    assert computed == h + sum(len(ids) - h - 1 for ids, _ in spans)
    usage = data["usage"]
    assert usage["prompt_tokens"] == sum(len(ids) for ids, _ in spans)
    assert usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"] == computed
    assert usage["completion_tokens"] == 0
    assert [c["finish_reason"] for c in data["choices"]] == ["length"] * 4


def test_logprob_start_char_errors(pagoda_server, served_model):
    base = {"model": served_model, "max_tokens": 0, "prompt_logprobs": 0, "logprob_start_char": 1}
    ids = _tokens(pagoda_server, served_model, prompt="Hello there")
    for prompt in (ids, [ids, ids], ["Hello there", "Hi"], ["Hello", ""]):
        response = _post(
            pagoda_server, "/v1/completions", {**base, "prompt": prompt, "logprob_start_char": 3}
        )
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] in ("logprob_start_char", "prompt"), response.text
