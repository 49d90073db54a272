"""What would stall the server's event loop stays off it.

The tokenizer work (prompts, chat templates, /tokenize, /detokenize): while a burst of requests is
held inside the tokenizer, /health answers and a stream already running keeps sending its chunks;
once the tokenizer goes on, every request of the burst is answered as without the hold (errors
included), and requests reach the engine in the order they were tokenized. A server in this process
(uvicorn on a thread) whose tokenizer waits at a gate for the burst's inputs; no timing decides a
result beyond generous timeouts.

The garbage collector's walks over the start-up heap: `pagoda serve` freezes it before serving."""

from __future__ import annotations

import gc
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import httpx
import pytest

from inproc_server import serve_in_thread
from pagoda.tokenizer import apply_chat_template

pytestmark = pytest.mark.timeout(300)

MARK = "burst-"  # a text (or message) holding it is one of the burst's: its tokenization waits
NUM_BURST = 8
BAD = 3  # this burst request asks for more tokens than its prompt leaves room for: a 400 after tokenizing
MAX_MODEL_LEN = 512
QUICK = httpx.Timeout(15.0)  # far above what /health or a stream's next chunk take when the loop is free


class GatedTokenizer:
    """The model's tokenizer, except that a call on one of the burst's inputs (a text or message
    with MARK; ids starting with `mark_ids` for decode) first waits until `gate` opens, then records
    which burst request passed. Everything else is the real tokenizer's."""

    def __init__(self, inner) -> None:
        self._inner = inner
        self.gate = threading.Event()
        self.entered = threading.Semaphore(0)
        self.passed: list[int] = []  # burst request numbers, in the order the tokenizer took them
        self.mark_ids = inner.convert_tokens_to_ids(list("BURST"))

    def reset(self) -> None:
        self.gate.clear()
        self.entered = threading.Semaphore(0)
        self.passed.clear()

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def _hold(self, text: str) -> None:
        self.entered.release()
        if not self.gate.wait(120):  # a safety net: the test opens the gate
            raise RuntimeError("the gate was never opened")
        self.passed.append(int(text.split(MARK, 1)[1].split(":", 1)[0]))

    def __call__(self, text, *args, **kwargs):
        if isinstance(text, str) and MARK in text:
            self._hold(text)
        return self._inner(text, *args, **kwargs)

    def apply_chat_template(self, messages, *args, **kwargs):
        marked = [m["content"] for m in messages if MARK in (m.get("content") or "")]
        if marked:
            self._hold(marked[0])
        return self._inner.apply_chat_template(messages, *args, **kwargs)

    def decode(self, token_ids, *args, **kwargs):
        ids = list(token_ids)
        if ids[: len(self.mark_ids)] == self.mark_ids:
            # Decode's burst request number follows the mark as digit tokens, then ":".
            self._hold(MARK + self._inner.decode(ids[len(self.mark_ids) :]))
        return self._inner.decode(token_ids, *args, **kwargs)


@pytest.fixture(scope="module")
def served(tiny_llama_dir: str):
    """(base URL, the gated tokenizer, the real one, the AsyncLLM's add order) of a pagoda app served
    by uvicorn on a thread of this process."""

    from pagoda.config import EngineArgs
    from pagoda.engine.llm_engine import LLMEngine
    from pagoda.entrypoints.openai.app import build_state, create_app
    from pagoda.entrypoints.server_args import ServerArgs

    engine = LLMEngine(EngineArgs(model=tiny_llama_dir, dtype="float32", num_kv_blocks=512))
    assert engine.max_model_len == MAX_MODEL_LEN
    real = engine.tokenizer
    gated = GatedTokenizer(real)
    engine.tokenizer = gated  # what the server reads; the engine's output processor keeps the real one
    state = build_state(engine, ServerArgs())
    added: list[list[int]] = []  # the first prompt of every add_requests call, in call order
    add_requests = state.engine.add_requests

    async def recording_add_requests(request_ids, prompts, *args, **kwargs):
        added.append(list(prompts[0]))
        return await add_requests(request_ids, prompts, *args, **kwargs)

    state.engine.add_requests = recording_add_requests  # type: ignore[method-assign]
    with serve_in_thread(create_app(state)) as url:
        yield url, gated, real, added
        gated.gate.set()
    state.engine.shutdown()


def _text(i: int) -> str:
    return f"{MARK}{i}: " + " ".join(f"word{j}" for j in range(12))


def _burst(kind: str, real) -> list[tuple[str, dict, list[int] | None]]:
    """(path, body, prompt ids the engine gets, or None) of each burst request."""
    requests = []
    for i in range(NUM_BURST):
        text = _text(i)
        if kind in ("completion", "chat"):
            if kind == "completion":
                path, body = "/v1/completions", {"prompt": text}
                ids = real(text)["input_ids"]
            else:
                messages = [{"role": "user", "content": text}]
                path, body = "/v1/chat/completions", {"messages": messages}
                ids = apply_chat_template(real, messages)
            room = MAX_MODEL_LEN - len(ids)
            body |= {"max_tokens": room + 1 if i == BAD else 4, "temperature": 0.0}
            requests.append((path, body, None if i == BAD else ids))
        elif kind == "tokenize":
            requests.append(("/tokenize", {"prompt": text}, None))
        elif kind == "tokenize_chat":
            requests.append(("/tokenize", {"messages": [{"role": "user", "content": text}]}, None))
        else:
            ids = real.convert_tokens_to_ids(list("BURST")) + real(f"{i}: " + text)["input_ids"]
            requests.append(("/detokenize", {"tokens": ids}, None))
    return requests


def _check_answer(kind: str, real, i: int, body: dict, response: httpx.Response) -> None:
    if kind in ("completion", "chat") and i == BAD:
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "max_tokens"
        return
    assert response.status_code == 200, response.text
    out = response.json()
    if kind == "completion":
        assert out["usage"]["prompt_tokens"] == len(real(body["prompt"])["input_ids"])
    elif kind == "chat":
        assert out["usage"]["prompt_tokens"] == len(apply_chat_template(real, body["messages"]))
    elif kind == "tokenize":
        assert out["tokens"] == real(body["prompt"])["input_ids"]
    elif kind == "tokenize_chat":
        assert out["tokens"] == apply_chat_template(real, body["messages"])
    else:
        assert out["prompt"] == real.decode(body["tokens"])


@pytest.mark.parametrize("kind", ["completion", "chat", "tokenize", "tokenize_chat", "detokenize"])
def test_health_and_streams_answer_while_a_burst_is_tokenized(served, kind: str) -> None:
    base, gated, real, added = served
    gated.reset()
    added.clear()
    burst = _burst(kind, real)
    stream_body = {
        "prompt": "Hello",
        "max_tokens": 24,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        httpx.Client(base_url=base, timeout=QUICK) as quick,
        httpx.Client(base_url=base, timeout=120.0) as slow,
        ThreadPoolExecutor(NUM_BURST) as pool,
    ):
        futures: list[Future[httpx.Response]] = []
        try:
            with quick.stream("POST", "/v1/completions", json=stream_body) as stream:
                lines = (line for line in stream.iter_lines() if line.startswith("data: "))
                assert next(lines) != "data: [DONE]"  # the stream runs
                futures = [pool.submit(slow.post, path, json=body) for path, body, _ in burst]
                assert gated.entered.acquire(timeout=60), "the burst never reached the tokenizer"
                # The burst is held in the tokenizer; the event loop serves on.
                assert quick.get("/health").status_code == 200
                rest = list(lines)
                assert rest[-1] == "data: [DONE]" and len(rest) > 1
                assert quick.get("/health").status_code == 200
                assert not gated.gate.is_set() and not any(f.done() for f in futures)
        finally:
            gated.gate.set()
        responses = [f.result() for f in futures]
    for i, ((_, body, _), response) in enumerate(zip(burst, responses, strict=True)):
        _check_answer(kind, real, i, body, response)
    assert sorted(gated.passed) == list(range(NUM_BURST))
    # Requests reach the engine in the order they were tokenized (the stream's prompt came first).
    expected = {tuple(ids): i for i, (_, _, ids) in enumerate(burst) if ids is not None}
    order = [expected[tuple(p)] for p in added if tuple(p) in expected]
    assert order == [i for i in gated.passed if i in expected.values()]


def test_serve_freezes_the_start_up_heap(tiny_llama_dir: str, monkeypatch) -> None:
    import uvicorn

    from pagoda.config import EngineArgs
    from pagoda.entrypoints.openai.app import run_server
    from pagoda.entrypoints.server_args import ServerArgs

    frozen_when_serving: list[int] = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self: frozen_when_serving.append(gc.get_freeze_count()))
    try:
        assert gc.get_freeze_count() == 0
        code = run_server(EngineArgs(model=tiny_llama_dir, dtype="float32", num_kv_blocks=64), ServerArgs())
    finally:
        gc.unfreeze()
    assert code == 0
    (count,) = frozen_when_serving
    assert count > 10_000  # the modules, the model and the tokenizer


def test_whole_responses_are_serialized_by_pydantic() -> None:
    """Non-streamed responses go out as pydantic writes them (not through FastAPI's encoder on the
    event loop): the same JSON as a stream's chunks, a non-finite logprob as null."""
    import json

    from pagoda.entrypoints.openai.protocol import ChatLogprobs, ChatLogprobToken
    from pagoda.entrypoints.openai.serving_common import json_response

    body = ChatLogprobs(content=[ChatLogprobToken(token="a", logprob=float("-inf"), bytes=[97])])
    response = json_response(body)
    assert response.media_type == "application/json"
    assert response.body == body.model_dump_json().encode()
    assert json.loads(response.body)["content"][0]["logprob"] is None
