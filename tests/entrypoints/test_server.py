"""The OpenAI-compatible server, end to end: a real `pagoda serve` process on a tiny random model,
driven by the official `openai` client (streaming and not) and by raw HTTP for errors, auth,
disconnects and overload. Every request is bounded by a timeout."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import openai
import pytest
from transformers.convert_slow_tokenizer import bytes_to_unicode

from pagoda.tokenizer import load_tokenizer
from server_utils import ServerProcess, flags_to_args, metrics, parse_metrics, wait_idle

pytestmark = pytest.mark.timeout(180)

TIMEOUT = 60.0
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
ABORTED = 'vllm:request_success_total{finished_reason="abort"}'
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: str):
    return load_tokenizer(tiny_llama_dir)


def _post(base: str, path: str, body: object, headers: dict[str, str] | None = None, **kw) -> httpx.Response:
    if isinstance(body, str | bytes):
        return httpx.post(
            base + path, content=body, headers={"content-type": "application/json"}, timeout=TIMEOUT, **kw
        )
    return httpx.post(base + path, json=body, headers=headers, timeout=TIMEOUT, **kw)


def _sse_events(response: httpx.Response) -> list[str]:
    return [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]


def _stream_completion(client: openai.OpenAI, **kw) -> tuple[dict[int, str], list]:
    chunks = list(client.completions.create(stream=True, **kw))
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    return texts, chunks


def _stream_chat(client: openai.OpenAI, **kw) -> tuple[dict[int, str], list]:
    chunks = list(client.chat.completions.create(stream=True, **kw))
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
    return texts, chunks


# ---- basics -------------------------------------------------------------------------------------------
def test_health_models_and_version_fields(pagoda_server: str, served_model: str, tiny_llama_dir: str) -> None:
    assert httpx.get(pagoda_server + "/health", timeout=TIMEOUT).status_code == 200
    listing = httpx.get(pagoda_server + "/v1/models", timeout=TIMEOUT).json()
    assert listing["object"] == "list"
    (card,) = listing["data"]
    assert card["id"] == served_model == tiny_llama_dir
    assert card["max_model_len"] == 512


def test_completion_usage_counts_tokens(openai_client: openai.OpenAI, served_model: str, tokenizer) -> None:
    prompt = "Hello world, this is a test"
    out = openai_client.completions.create(model=served_model, prompt=prompt, max_tokens=7, **GREEDY)
    (choice,) = out.choices
    assert out.object == "text_completion" and out.model == served_model
    assert choice.finish_reason == "length"
    assert out.usage.prompt_tokens == len(tokenizer(prompt)["input_ids"])
    assert out.usage.completion_tokens == 7
    assert out.usage.total_tokens == out.usage.prompt_tokens + 7


def test_streamed_text_equals_non_streamed(openai_client: openai.OpenAI, served_model: str) -> None:
    for prompt in ("The quick brown fox", "你好，世界 😀", [5, 17, 200, 31]):
        whole = openai_client.completions.create(model=served_model, prompt=prompt, max_tokens=24, **GREEDY)
        texts, chunks = _stream_completion(
            openai_client, model=served_model, prompt=prompt, max_tokens=24, **GREEDY
        )
        assert texts == {0: whole.choices[0].text}
        assert chunks[-1].choices[0].finish_reason == "length"


def _byte_token(tokenizer, byte: int) -> int:
    """The id of the byte-level (GPT-2 alphabet) token that stands for one byte."""
    return tokenizer.convert_tokens_to_ids(bytes_to_unicode()[byte])


@pytest.mark.parametrize(("leads", "num_bytes"), [((0xE4, 0xE5, 0xE6, 0xE7, 0xE8, 0xE9), 3), ((0xF0,), 4)])
def test_streamed_multibyte_output_equals_non_streamed(
    openai_client: openai.OpenAI, served_model: str, tokenizer, leads: tuple[int, ...], num_bytes: int
) -> None:
    # The tiny tokenizer has one token per byte, so a CJK character (3 bytes) or an emoji (4 bytes)
    # always spans several tokens, and so several stream chunks. Biases restrict sampling to lead and
    # continuation bytes; seeds are tried until one output holds such a character.
    bias = {str(_byte_token(tokenizer, b)): 97.0 for b in range(0x80, 0xC0)}
    bias |= {str(_byte_token(tokenizer, lead)): 100.0 for lead in leads}
    kw = {
        "model": served_model,
        "max_tokens": 24,
        "temperature": 1.0,
        "logit_bias": bias,
        "extra_body": {"ignore_eos": True},
    }
    messages = [{"role": "user", "content": "Say it"}]
    for seed in range(10):
        whole = openai_client.completions.create(prompt="Say it:", seed=seed, **kw).choices[0].text
        if _has_char_of_length(whole, num_bytes):
            break
    else:
        pytest.fail(f"no output with a {num_bytes}-byte character in 10 seeds")
    texts, _ = _stream_completion(openai_client, prompt="Say it:", seed=seed, **kw)
    assert texts == {0: whole}
    whole = (
        openai_client.chat.completions.create(messages=messages, seed=seed, **kw).choices[0].message.content
    )
    texts, _ = _stream_chat(openai_client, messages=messages, seed=seed, **kw)
    assert texts == {0: whole}


def _has_char_of_length(text: str, num_bytes: int) -> bool:
    return any(len(ch.encode()) == num_bytes and ch != "\ufffd" for ch in text)


def test_raw_stream_format_and_usage(pagoda_server: str, served_model: str) -> None:
    body = {
        "model": served_model,
        "prompt": "Hello",
        "max_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    response = _post(pagoda_server, "/v1/completions", body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = _sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert all("usage" in c for c in chunks)
    *content, last = chunks
    assert all(c["usage"] is None for c in content)
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 5
    assert set(last["usage"]["prompt_tokens_details"]) == {"cached_tokens"}
    # Without include_usage no chunk carries a usage field.
    body.pop("stream_options")
    events = _sse_events(_post(pagoda_server, "/v1/completions", body))
    assert events[-1] == "[DONE]" and all("usage" not in json.loads(e) for e in events[:-1])


def test_chat_stream_and_non_stream(openai_client: openai.OpenAI, served_model: str) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "And now?"},
    ]
    whole = openai_client.chat.completions.create(
        model=served_model, messages=messages, max_tokens=12, **GREEDY
    )
    (choice,) = whole.choices
    assert whole.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason == "length" and whole.usage.completion_tokens == 12
    texts, chunks = _stream_chat(
        openai_client,
        model=served_model,
        messages=messages,
        max_completion_tokens=12,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    assert texts == {0: choice.message.content}
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert chunks[-2].choices[0].finish_reason == "length"


def test_echo(openai_client: openai.OpenAI, served_model: str) -> None:
    whole = openai_client.completions.create(
        model=served_model, prompt="Echo me", max_tokens=4, echo=True, **GREEDY
    )
    assert whole.choices[0].text.startswith("Echo me")
    texts, _ = _stream_completion(
        openai_client, model=served_model, prompt="Echo me", max_tokens=4, echo=True, **GREEDY
    )
    assert texts == {0: whole.choices[0].text}


# ---- sampling -------------------------------------------------------------------------------------------
def test_n_and_several_prompts(openai_client: openai.OpenAI, served_model: str) -> None:
    prompts = ["First prompt", "Second"]
    kw = {
        "model": served_model,
        "n": 2,
        "max_tokens": 6,
        "temperature": 1.0,
        "seed": 3,
        "extra_body": {"ignore_eos": True},
    }
    out = openai_client.completions.create(prompt=prompts, **kw)
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert out.usage.completion_tokens == 24
    assert out.usage.prompt_tokens == sum(
        openai_client.completions.create(prompt=p, **kw).usage.prompt_tokens for p in prompts
    )
    texts, _ = _stream_completion(openai_client, prompt=prompts, **kw)
    assert texts == {c.index: c.text for c in out.choices}
    chat = dict(
        model=served_model,
        messages=[{"role": "user", "content": "Hi"}],
        n=3,
        max_tokens=8,
        temperature=1.0,
        seed=11,
    )
    whole = openai_client.chat.completions.create(**chat)
    assert sorted(c.index for c in whole.choices) == [0, 1, 2]
    texts, chunks = _stream_chat(openai_client, **chat)
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert {c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role} == {0, 1, 2}


def test_seed_reproducibility(openai_client: openai.OpenAI, served_model: str) -> None:
    kw = {"model": served_model, "prompt": "Once upon a time", "max_tokens": 16, "temperature": 1.0}
    a = openai_client.completions.create(seed=7, **kw).choices[0].text
    b = openai_client.completions.create(seed=7, **kw).choices[0].text
    c = openai_client.completions.create(seed=8, **kw).choices[0].text
    assert a == b
    assert a != c


def test_stop_string(openai_client: openai.OpenAI, served_model: str) -> None:
    kw = {"model": served_model, "prompt": "Stop somewhere", **GREEDY}
    text = openai_client.completions.create(max_tokens=40, **kw).choices[0].text
    start = next(i for i in range(2, len(text) - 2) if "\ufffd" not in text[i - 1 : i + 2])
    stop = text[start : start + 2]
    out = openai_client.completions.create(max_tokens=40, stop=[stop], **kw).choices[0]
    assert out.finish_reason == "stop"
    assert out.text == text[: text.index(stop)]
    texts, chunks = _stream_completion(openai_client, max_tokens=40, stop=stop, **kw)
    assert texts == {0: out.text} and chunks[-1].choices[0].finish_reason == "stop"


def test_completion_logprobs(openai_client: openai.OpenAI, served_model: str) -> None:
    kw = {"model": served_model, "prompt": "Logprobs please", "max_tokens": 6, "logprobs": 3, **GREEDY}
    out = openai_client.completions.create(**kw).choices[0]
    lp = out.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0 and 1 <= len(top) <= 4
        assert logprob == pytest.approx(max(top.values()))  # greedy: the chosen token is the most likely
        assert top[token] == pytest.approx(logprob)
    assert lp.text_offset == sorted(lp.text_offset)
    _, chunks = _stream_completion(openai_client, **kw)
    streamed = [t for c in chunks for t in (c.choices[0].logprobs.tokens if c.choices[0].logprobs else [])]
    assert streamed == lp.tokens


def test_chat_logprobs(openai_client: openai.OpenAI, served_model: str) -> None:
    out = openai_client.chat.completions.create(
        model=served_model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=5,
        logprobs=True,
        top_logprobs=2,
        **GREEDY,
    )
    content = out.choices[0].logprobs.content
    assert len(content) == 5
    for item in content:
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob)
        assert item.bytes == list(item.token.encode())


def test_extras_and_logit_bias(openai_client: openai.OpenAI, served_model: str, tokenizer) -> None:
    target = tokenizer("Z", add_special_tokens=False)["input_ids"][0]
    out = openai_client.completions.create(
        model=served_model, prompt="Anything", max_tokens=5, temperature=0.0, logit_bias={str(target): 100}
    )
    assert out.choices[0].text == "ZZZZZ"
    out = openai_client.completions.create(
        model=served_model,
        prompt="Anything",
        max_tokens=8,
        temperature=0.9,
        top_p=0.9,
        seed=1,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        user="someone",
        extra_body={
            "top_k": 20,
            "min_p": 0.01,
            "repetition_penalty": 1.1,
            "min_tokens": 8,
            "ignore_eos": False,
        },
    )
    assert out.usage.completion_tokens == 8
    out = openai_client.completions.create(
        model=served_model,
        prompt="Anything",
        max_tokens=5,
        temperature=0.0,
        logit_bias={str(target): 100},
        extra_body={"stop_token_ids": [target]},
    )
    assert out.choices[0].finish_reason == "stop" and out.choices[0].stop_reason == target
    assert out.choices[0].text == "" and out.usage.completion_tokens == 1


def test_response_format_constrains_the_output(openai_client: openai.OpenAI, served_model: str) -> None:
    schema = {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green"]}},
        "required": ["color"],
        "additionalProperties": False,
    }
    kw = {"model": served_model, "messages": HI, "max_tokens": 60, "temperature": 0.0}
    json_schema = {"type": "json_schema", "json_schema": {"name": "color", "schema": schema}}
    out = openai_client.chat.completions.create(response_format=json_schema, **kw).choices[0]
    assert out.finish_reason == "stop" and json.loads(out.message.content)["color"] in ("red", "green")
    texts, _ = _stream_chat(openai_client, response_format=json_schema, **kw)
    assert texts == {0: out.message.content}
    bad = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "no-such-type"}}}
    with pytest.raises(openai.BadRequestError):
        openai_client.chat.completions.create(response_format=bad, **kw)
    # Any JSON object: a random model may not close it within max_tokens, but it must open one.
    out = openai_client.chat.completions.create(response_format={"type": "json_object"}, **kw).choices[0]
    assert out.message.content.lstrip().startswith("{")
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.message.content), dict)


def test_prefix_cache_hits_show_in_usage_and_metrics(
    openai_client: openai.OpenAI, served_model: str, pagoda_server: str
) -> None:
    prompt = "A long shared prefix that spans several KV blocks of sixteen tokens each. " * 2
    before = metrics(pagoda_server)
    first = openai_client.completions.create(model=served_model, prompt=prompt, max_tokens=2, **GREEDY)
    second = openai_client.completions.create(model=served_model, prompt=prompt, max_tokens=2, **GREEDY)
    after = metrics(pagoda_server)
    num_prompt = first.usage.prompt_tokens
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached == num_prompt - 1 > 0  # token-granular: all but the last token (its logits are needed)
    assert after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"] >= cached
    assert (
        after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"] >= 2 * num_prompt
    )
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == 2 * num_prompt
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 4
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert after[f"vllm:{name}_count"] - before[f"vllm:{name}_count"] == 2
    assert (
        after["vllm:inter_token_latency_seconds_count"] - before["vllm:inter_token_latency_seconds_count"]
        == 2
    )


def test_metrics_names(pagoda_server: str) -> None:
    text = httpx.get(pagoda_server + "/metrics", timeout=TIMEOUT).text
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:num_preemptions_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:spec_decode_num_drafts_total",
        "vllm:spec_decode_num_draft_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_total",
    ):
        assert f"\n{name}{{" in text, name


def test_tokenize_and_detokenize(pagoda_server: str, tokenizer) -> None:
    out = _post(pagoda_server, "/tokenize", {"prompt": "Hello world"}).json()
    assert out["tokens"] == tokenizer("Hello world")["input_ids"] and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == 512
    assert _post(pagoda_server, "/detokenize", {"tokens": out["tokens"]}).json() == {"prompt": "Hello world"}
    chat = _post(pagoda_server, "/tokenize", {"messages": [{"role": "user", "content": "Hi"}]}).json()
    expected = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert chat["tokens"] == list(expected)
    bad = _post(pagoda_server, "/detokenize", {"tokens": [10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


# ---- errors ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions", {"prompt": "hi", "foo": 1}, 400, "foo"),
        ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
        ("/v1/chat/completions", {"messages": HI, "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/chat/completions", {"messages": HI, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
        ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
        ("/v1/completions", {"prompt": "x" * 600}, 400, "prompt"),
        ("/v1/completions", {"prompt": "hello", "max_tokens": 510}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": [10**6]}, 400, "prompt"),
        ("/v1/completions", {"prompt": []}, 400, "prompt"),
        ("/v1/completions", {}, 400, "prompt"),
        ("/v1/completions", {"prompt": "hi", "model": "no-such-model"}, 404, "model"),
        ("/v1/completions", {"prompt": "hi", "suffix": "!"}, 400, "suffix"),
        ("/v1/completions", {"prompt": "hi", "best_of": 3}, 400, "best_of"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"999999": 1}}, 400, "logit_bias"),
        (
            "/v1/completions",
            {"prompt": "hi", "stream_options": {"include_usage": True}},
            400,
            "stream_options",
        ),
        (
            "/v1/completions",
            {"prompt": "hi", "echo": True, "max_tokens": 0, "stream": True, "prompt_logprobs": 0},
            400,
            "prompt_logprobs",
        ),
        ("/v1/completions", {"prompt": "hi", "logprobs": 50}, 400, "logprobs"),
        ("/v1/completions", {"prompt": "hi", "stop_token_ids": [10**6]}, 400, "stop_token_ids"),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"messages": HI, "tools": [{"type": "function"}]}, 400, "tools"),
        ("/v1/chat/completions", {"messages": HI, "tool_choice": "auto"}, 400, "tool_choice"),
        ("/v1/chat/completions", {"messages": HI, "top_logprobs": 2}, 400, "top_logprobs"),
        (
            "/v1/chat/completions",
            {"messages": HI, "max_completion_tokens": 1000},
            400,
            "max_completion_tokens",
        ),
        ("/v1/chat/completions", {"messages": HI, "store": True}, 400, "store"),
        (
            "/v1/chat/completions",
            {"messages": HI, "response_format": {"type": "json_schema"}},
            400,
            "response_format",
        ),
        (
            "/v1/chat/completions",
            {"messages": HI, "response_format": {"type": "xml"}},
            400,
            "response_format",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            400,
            "messages.0.content",
        ),
    ],
)
def test_bad_requests_get_openai_errors(
    pagoda_server: str, path: str, body: dict, status: int, param: str
) -> None:
    response = _post(pagoda_server, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"]
    assert error["param"] is not None and error["param"].startswith(param), error


def test_malformed_bodies_and_routes(pagoda_server: str) -> None:
    for response in (
        _post(pagoda_server, "/v1/completions", "{not json"),
        _post(pagoda_server, "/v1/completions", "[1, 2]"),
        httpx.get(pagoda_server + "/v1/nothing", timeout=TIMEOUT),
        httpx.get(pagoda_server + "/v1/completions", timeout=TIMEOUT),
    ):
        assert response.status_code in (400, 404, 405), response.text
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(pagoda_server + "/health", timeout=TIMEOUT).status_code == 200


# ---- disconnects and concurrency ---------------------------------------------------------------------------
LONG = {"prompt": "Go on and on", "max_tokens": 480, "temperature": 0, "ignore_eos": True}


def test_disconnect_mid_stream_aborts_and_frees_blocks(pagoda_server: str) -> None:
    aborted = metrics(pagoda_server).get(ABORTED, 0.0)
    with httpx.stream(
        "POST", pagoda_server + "/v1/completions", json={**LONG, "stream": True}, timeout=TIMEOUT
    ) as r:
        assert r.status_code == 200
        events = 0
        for line in r.iter_lines():
            events += line.startswith("data: ")
            if events == 3:
                break
    m = wait_idle(pagoda_server)
    assert m.get(ABORTED, 0.0) == aborted + 1


def test_abandoned_non_streaming_request_is_aborted(pagoda_server: str) -> None:
    async def abandon(path: str, body: dict) -> None:
        """Send a long request, and drop the connection as soon as the server runs it."""
        async with httpx.AsyncClient(base_url=pagoda_server, timeout=TIMEOUT) as c:
            task = asyncio.create_task(c.post(path, json=body))
            deadline = time.monotonic() + TIMEOUT
            while parse_metrics((await c.get("/metrics")).text)["vllm:num_requests_running"] == 0:
                assert not task.done(), task.result().text
                assert time.monotonic() < deadline
                await asyncio.sleep(0.005)
            task.cancel()

    aborted = metrics(pagoda_server).get(ABORTED, 0.0)
    asyncio.run(abandon("/v1/completions", LONG))
    chat = {"messages": HI, **{k: v for k, v in LONG.items() if k != "prompt"}}
    asyncio.run(abandon("/v1/chat/completions", chat))
    m = wait_idle(pagoda_server)
    assert m.get(ABORTED, 0.0) == aborted + 2


def test_many_connections_dropped_at_once_free_their_requests(pagoda_server: str) -> None:
    """64 clients, half streaming and half not, all drop their connections while their requests
    run or wait: every request is aborted and every KV block comes back; the server keeps serving."""
    n = 64
    short = {**LONG, "max_tokens": 200}

    async def drop_all() -> None:
        async with httpx.AsyncClient(base_url=pagoda_server, timeout=TIMEOUT) as c:

            async def stream() -> None:
                async with c.stream("POST", "/v1/completions", json={**short, "stream": True}) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            await asyncio.sleep(3600)  # dropped mid-stream by the cancel below

            tasks = [
                asyncio.create_task(stream() if i % 2 else c.post("/v1/completions", json=short))
                for i in range(n)
            ]
            deadline = time.monotonic() + TIMEOUT
            while True:  # until every request is in the engine (running or waiting)
                m = parse_metrics((await c.get("/metrics")).text)
                if m["vllm:num_requests_running"] + m["vllm:num_requests_waiting"] == n:
                    break
                assert time.monotonic() < deadline and not any(t.done() for t in tasks), m
                await asyncio.sleep(0.01)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    aborted = metrics(pagoda_server).get(ABORTED, 0.0)
    asyncio.run(drop_all())
    m = wait_idle(pagoda_server, timeout_s=TIMEOUT)
    assert m.get(ABORTED, 0.0) == aborted + n
    assert httpx.post(
        pagoda_server + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=TIMEOUT
    ).is_success


def test_concurrent_streams_match_sequential_greedy(
    pagoda_server: str, openai_client: openai.OpenAI, served_model: str
) -> None:
    prompts = [f"Request {i}: tell me about {i * 7 % 13} things" for i in range(64)]
    kw = {"model": served_model, "max_tokens": 10, **GREEDY}
    sequential = [openai_client.completions.create(prompt=p, **kw).choices[0].text for p in prompts]

    async def one(aclient: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await aclient.completions.create(prompt=prompt, stream=True, **kw)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def run_all() -> list[str]:
        aclient = openai.AsyncOpenAI(
            base_url=pagoda_server + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT
        )
        async with aclient:
            return await asyncio.wait_for(asyncio.gather(*(one(aclient, p) for p in prompts)), TIMEOUT * 2)

    assert asyncio.run(run_all()) == sequential
    wait_idle(pagoda_server)


# ---- a second server: API key, overload, graceful shutdown -----------------------------------------------------
KEY = "sekret-key"


@pytest.fixture(scope="module")
def guarded(tiny_llama_dir: str):
    flags = {
        "dtype": "float32",
        "num_kv_blocks": 256,
        "api_key": KEY,
        "max_num_seqs": 1,
        "max_waiting_requests": 1,
    }
    server = ServerProcess(tiny_llama_dir, flags_to_args(flags)).start()
    yield server
    server.kill()


def test_api_key(guarded: ServerProcess) -> None:
    base = guarded.base_url
    assert httpx.get(base + "/health", timeout=TIMEOUT).status_code == 200
    good = {"Authorization": f"Bearer {KEY}"}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        for method, path in (
            ("GET", "/v1/models"),
            ("GET", "/metrics"),
            ("POST", "/v1/completions"),
            ("POST", "/tokenize"),
        ):
            response = httpx.request(
                method, base + path, headers=headers, json={"prompt": "hi"}, timeout=TIMEOUT
            )
            assert response.status_code == 401, (path, headers)
            assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(base + "/v1/models", headers=good, timeout=TIMEOUT).status_code == 200
    keyed = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=TIMEOUT)
    assert keyed.completions.create(model=keyed.models.list().data[0].id, prompt="hi", max_tokens=2).choices
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base + "/v1", api_key="nope", max_retries=0).models.list()


def test_overload_answers_503(guarded: ServerProcess) -> None:
    base = guarded.base_url
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"prompt": "Busy", "max_tokens": 150, "temperature": 0, "ignore_eos": True}

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=base, headers=headers, timeout=TIMEOUT) as c:
            return await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(4)))

    responses = asyncio.run(run())
    codes = sorted(r.status_code for r in responses)
    assert codes[0] == 200 and codes[-1] == 503, codes
    error = next(r for r in responses if r.status_code == 503).json()["error"]
    assert error["code"] == "server_overloaded" and "max_waiting_requests" in error["message"]
    wait_idle(base, headers=headers)


def test_sigint_finishes_in_flight_stream_then_exits_0(guarded: ServerProcess) -> None:
    body = {"prompt": "Finish me", "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream(
        "POST", guarded.base_url + "/v1/completions", json=body, headers=headers, timeout=TIMEOUT
    ) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert guarded.process is not None
        guarded.process.send_signal(signal.SIGINT)
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"
    assert guarded.stop(timeout_s=30) == 0
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            httpx.get(guarded.base_url + "/health", timeout=1.0)
        except httpx.ConnectError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the server still answers after it exited")
