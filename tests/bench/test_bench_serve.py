"""The serving benchmark end to end against a fake OpenAI-compatible streaming server on 127.0.0.1, its
datasets, its CLI and the sweep chart; and one run against a real pagoda server when one is provided."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import socket
from pathlib import Path

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from inproc_server import serve_in_thread
from pagoda.bench import cli
from pagoda.bench.datasets import DATASET_NAMES, BenchRequest, DatasetConfig, load_tokenizer, sample_requests
from pagoda.bench.serve import ServeConfig, normalize_base_url, resolve_model, run_benchmark, write_json
from pagoda.bench.sweep import SweepPoint, plot_sweep, run_sweep

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# --- a fake OpenAI-compatible server ------------------------------------------------------------------------
# It streams max_tokens chunks " t0", " t1", ...; prompt tokens are the prompt's whitespace-separated words.
# Markers in the (last user) prompt make it misbehave: FAIL500, BROKEN (connection cut mid-stream),
# NODONE (clean end without [DONE]), ERRORCHUNK (an error object inside the stream).


class FakeServer:
    def __init__(self) -> None:
        self.token_delay_s = 0.001
        self.send_usage = True
        self.bodies: list[dict] = []
        self.auth_headers: list[str | None] = []
        self.url = ""  # set once it serves (the fake_server fixture)
        self.app = FastAPI()
        self.app.get("/v1/models")(self._models)
        self.app.post("/v1/completions")(self._completions)
        self.app.post("/v1/chat/completions")(self._chat)

    def reset(self) -> None:
        self.token_delay_s = 0.001
        self.send_usage = True
        self.bodies.clear()
        self.auth_headers.clear()

    async def _models(self) -> dict:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    async def _completions(self, request: Request):
        body = await request.json()
        return self._respond(request, body, body["prompt"], len(body["prompt"].split()), chat=False)

    async def _chat(self, request: Request):
        body = await request.json()
        messages = body["messages"]
        words = sum(len(m["content"].split()) for m in messages)
        return self._respond(request, body, messages[-1]["content"], words, chat=True)

    def _respond(self, request: Request, body: dict, text: str, prompt_tokens: int, chat: bool):
        self.bodies.append(body)
        self.auth_headers.append(request.headers.get("authorization"))
        if "FAIL500" in text:
            return JSONResponse({"error": {"message": "internal failure"}}, status_code=500)
        num_tokens = body["max_tokens"]
        include_usage = self.send_usage and body.get("stream_options", {}).get("include_usage")

        def chunk(piece: str) -> str:
            choice = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
            return "data: " + json.dumps({"id": "x", "choices": [choice]}) + "\n\n"

        async def stream():
            if chat:  # the role-only first chunk carries no content
                yield (
                    "data: "
                    + json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
                    + "\n\n"
                )
            for i in range(num_tokens):
                await asyncio.sleep(self.token_delay_s)
                if i == 1 and "BROKEN" in text:
                    raise RuntimeError("connection cut on purpose")
                if i == 1 and "NODONE" in text:
                    return
                if i == 1 and "ERRORCHUNK" in text:
                    yield "data: " + json.dumps({"error": {"message": "overloaded"}}) + "\n\n"
                yield chunk(f" t{i}")
            yield chunk("")
            if include_usage:
                usage = {"prompt_tokens": prompt_tokens, "completion_tokens": num_tokens}
                yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")


@pytest.fixture(scope="module")
def fake_server():
    server = FakeServer()
    with serve_in_thread(server.app, log_level="critical", lifespan="off") as url:
        server.url = url
        yield server


@pytest.fixture
def fake(fake_server):
    fake_server.reset()
    return fake_server


@pytest.fixture(scope="module")
def tiny_tokenizer_dir(tmp_path_factory) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(
        ["the quick brown fox jumps over the lazy dog", "t0 t1 t2 t3 hello world"] * 20, trainer
    )
    path = tmp_path_factory.mktemp("tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_tokenizer_dir):
    return load_tokenizer(tiny_tokenizer_dir)


def config_for(server: FakeServer, **changes) -> ServeConfig:
    return ServeConfig(base_url=server.url, model="fake-model", show_progress=False, **changes)


def words(n: int, seed: int = 0) -> list[BenchRequest]:
    return sample_requests(DatasetConfig("random", num_prompts=n, input_len=5, output_len=4, seed=seed))


# --- the client end to end -----------------------------------------------------------------------------------


def test_completions_run_is_complete_and_consistent(fake, tmp_path):
    requests = words(6)
    result = run_benchmark(config_for(fake, max_concurrency=3), requests)
    s = result.summary
    assert (s.completed, s.failed) == (6, 0)
    assert s.token_count_source == "usage"
    for r, req in zip(result.results, requests, strict=True):
        assert r.success and r.error is None
        assert r.num_chunks == 4 and len(r.itl_s) == 3
        assert r.output_tokens == 4  # what the server's usage reported
        assert r.prompt_tokens == len(req.prompt.split()) == 5
        assert 0 <= r.ttft_s <= r.e2el_s
        assert r.expected_output_len == 4
    assert s.total_output_tokens == 24 and s.total_input_tokens == 30
    assert s.itl_ms["count"] == 18 and s.tpot_ms["count"] == 6
    assert len(fake.bodies) == 6
    for body in fake.bodies:
        assert body["model"] == "fake-model" and body["max_tokens"] == 4 and body["temperature"] == 0.0
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert "ignore_eos" not in body
    assert set(fake.auth_headers) == {None}

    path = tmp_path / "result.json"
    write_json(result.to_dict(), path)
    data = json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    assert set(data) >= {"started_at", "config", "dataset", "environment", "summary", "requests"}
    assert data["config"]["request_rate"] == "inf" and data["config"]["max_concurrency"] == 3
    assert data["config"]["url"].endswith("/v1/completions") and "api_key" not in data["config"]
    assert {"python", "platform", "pagoda", "httpx"} <= set(data["environment"])
    assert len(data["requests"]) == 6
    assert sum(r["output_tokens"] for r in data["requests"]) == data["summary"]["total_output_tokens"]
    assert all(len(r["itl_s"]) == 3 and r["tpot_s"] is not None for r in data["requests"])
    assert data["summary"]["token_count_source"] == "usage"


def test_failures_are_counted_never_dropped(fake):
    prompts = ["fine one", "FAIL500 please", "BROKEN stream", "NODONE here", "ERRORCHUNK now", "fine two"]
    requests = [BenchRequest(prompt=p, output_len=4) for p in prompts]
    result = run_benchmark(config_for(fake, request_rate=200.0, seed=1), requests)
    s = result.summary
    assert (s.num_requests, s.completed, s.failed) == (6, 2, 4)
    errors = {prompts[r.index].split()[0]: r.error for r in result.results if not r.success}
    assert errors["FAIL500"].startswith("HTTP 500") and "internal failure" in errors["FAIL500"]
    assert "RemoteProtocolError" in errors["BROKEN"]
    assert errors["NODONE"] == "stream ended before 'data: [DONE]'"
    assert errors["ERRORCHUNK"].startswith("error in stream") and "overloaded" in errors["ERRORCHUNK"]
    assert sum(s.errors.values()) == 4
    assert s.total_output_tokens == 8
    table = result.format_table()
    assert "Failed requests:" in table and "HTTP 500" in table


def test_chat_multi_turn_resends_history_with_answers(fake):
    requests = sample_requests(
        DatasetConfig("multi-turn", num_prompts=2, input_len=3, output_len=3, num_turns=3)
    )
    result = run_benchmark(config_for(fake, endpoint="chat", request_rate=100.0), requests)
    assert result.summary.completed == 6
    answer = " t0 t1 t2"
    by_conversation: dict[int, list[list[dict]]] = {}
    for body in fake.bodies:
        first_user = body["messages"][0]["content"]
        conversation = next(
            r.conversation_id for r in requests if r.turn_index == 0 and r.prompt == first_user
        )
        by_conversation.setdefault(conversation, []).append(body["messages"])
    for conversation, sent in by_conversation.items():
        turns = [r.prompt for r in requests if r.conversation_id == conversation]
        assert [len(m) for m in sent] == [1, 3, 5]
        expected = []
        for turn, messages in zip(turns, sent, strict=True):
            expected.append({"role": "user", "content": turn})
            assert messages == expected
            expected.append({"role": "assistant", "content": answer})
    # Each turn went out only after the previous answer had fully arrived.
    for r in result.results:
        if r.turn_index:
            previous = next(
                p
                for p in result.results
                if p.conversation_id == r.conversation_id and p.turn_index == r.turn_index - 1
            )
            assert r.start_s >= previous.start_s + previous.e2el_s


def test_a_failed_turn_ends_its_conversation(fake):
    requests = [
        BenchRequest(prompt="FAIL500 first", output_len=2, conversation_id=0, turn_index=0),
        BenchRequest(prompt="second", output_len=2, conversation_id=0, turn_index=1),
        BenchRequest(prompt="other", output_len=2, conversation_id=1, turn_index=0),
    ]
    result = run_benchmark(config_for(fake), requests)
    assert [r.success for r in result.results] == [False, False, True]
    assert result.results[1].error == "not sent: turn 0 of its conversation failed"
    assert len(fake.bodies) == 2


def test_turns_out_of_order_are_rejected(fake):
    requests = [
        BenchRequest(prompt="b", output_len=2, conversation_id=0, turn_index=1),
        BenchRequest(prompt="a", output_len=2, conversation_id=0, turn_index=0),
    ]
    with pytest.raises(ValueError, match="out of order"):
        run_benchmark(config_for(fake), requests)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_shared_prefix_groups_share_their_system_prompt(fake, endpoint):
    config = DatasetConfig(
        "shared-prefix", num_prompts=6, input_len=3, output_len=2, prefix_len=12, num_groups=2
    )
    requests = sample_requests(config)
    result = run_benchmark(config_for(fake, endpoint=endpoint), requests)
    assert result.summary.completed == 6
    prefixes = {r.group_id: r.system_prompt for r in requests}
    assert len(set(prefixes.values())) == 2 and [r.group_id for r in requests] == [0, 1, 0, 1, 0, 1]
    for body in fake.bodies:
        if endpoint == "chat":
            system = body["messages"][0]
            assert system["role"] == "system" and system["content"] in prefixes.values()
        else:
            assert any(body["prompt"].startswith(p + "\n") for p in prefixes.values())
    assert {r.group_id for r in result.results} == {0, 1}


def test_token_counts_fall_back_to_the_tokenizer(fake, tiny_tokenizer):
    fake.send_usage = False
    requests = [BenchRequest(prompt="hello world", output_len=4)]
    for endpoint in ("completions", "chat"):
        result = run_benchmark(config_for(fake, endpoint=endpoint), requests, tiny_tokenizer)
        (r,) = result.results
        assert r.token_source == "tokenizer" and result.summary.token_count_source == "tokenizer"
        assert r.output_tokens == len(tiny_tokenizer.encode(" t0 t1 t2 t3", add_special_tokens=False))
        assert r.prompt_tokens == len(tiny_tokenizer.encode("hello world", add_special_tokens=False))


def test_chat_prompt_counts_use_the_chat_template(fake, tiny_tokenizer_dir):
    fake.send_usage = False
    tokenizer = load_tokenizer(tiny_tokenizer_dir)
    tokenizer.chat_template = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"
    result = run_benchmark(
        config_for(fake, endpoint="chat"), [BenchRequest(prompt="hello world", output_len=2)], tokenizer
    )
    (r,) = result.results
    assert r.prompt_tokens == len(tokenizer.encode("<s>hello world</s>", add_special_tokens=False))
    assert r.prompt_tokens == len(tokenizer.encode("hello world", add_special_tokens=False)) + 2


def test_token_counts_fall_back_to_chunks_without_tokenizer(fake):
    fake.send_usage = False
    result = run_benchmark(config_for(fake), words(2))
    assert {r.token_source for r in result.results} == {"chunks"}
    assert [r.output_tokens for r in result.results] == [4, 4]
    assert [r.prompt_tokens for r in result.results] == [None, None]
    assert result.summary.total_input_tokens is None and result.summary.total_token_throughput is None
    assert "streamed chunks" in result.format_table()


def test_ignore_eos_and_api_key_are_sent(fake):
    run_benchmark(config_for(fake, ignore_eos=True, api_key="sk-test", temperature=0.5), words(2))
    assert all(body["ignore_eos"] is True and body["temperature"] == 0.5 for body in fake.bodies)
    assert fake.auth_headers == ["Bearer sk-test", "Bearer sk-test"]


def test_resolve_model(fake):
    assert resolve_model(fake.url) == "fake-model"
    assert resolve_model(fake.url + "/v1/") == "fake-model"
    with socket.socket() as sock:  # a port with nobody listening
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}"
    with pytest.raises(ValueError, match="pass --model"):
        resolve_model(closed, timeout_s=2.0)


def test_unreachable_server_counts_as_failures():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}"
    result = run_benchmark(ServeConfig(closed, "m", show_progress=False, request_timeout_s=5.0), words(2))
    assert (result.summary.completed, result.summary.failed) == (0, 2)
    assert all(r.error.startswith("ConnectError") for r in result.results)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"base_url": "127.0.0.1:8000"}, "http://host:port"),
        ({"endpoint": "embeddings"}, "endpoint"),
        ({"request_rate": 0.0}, "request_rate"),
        ({"request_rate": math.nan}, "request_rate"),
        ({"burstiness": -1.0}, "burstiness"),
        ({"max_concurrency": 0}, "max_concurrency"),
        ({"temperature": -0.1}, "temperature"),
        ({"slos_ms": {"itl": 5.0}}, "SLO"),
        ({"model": ""}, "model"),
    ],
)
def test_serve_config_validation(changes, message):
    kwargs = {"base_url": "http://127.0.0.1:8000", "model": "m", **changes}
    with pytest.raises(ValueError, match=message):
        ServeConfig(**kwargs)


def test_base_url_normalization():
    assert normalize_base_url("http://h:1/") == "http://h:1"
    assert normalize_base_url("https://h/v1") == "https://h"
    assert ServeConfig("http://h:1/v1/", "m", endpoint="chat").url == "http://h:1/v1/chat/completions"


# --- datasets ---------------------------------------------------------------------------------------------------


def test_random_words_without_tokenizer():
    requests = sample_requests(DatasetConfig("random", num_prompts=5, input_len=7, output_len=3, seed=4))
    assert all(len(r.prompt.split()) == 7 and r.output_len == 3 and r.prompt_len is None for r in requests)
    assert requests == sample_requests(
        DatasetConfig("random", num_prompts=5, input_len=7, output_len=3, seed=4)
    )
    assert requests != sample_requests(
        DatasetConfig("random", num_prompts=5, input_len=7, output_len=3, seed=5)
    )


def test_random_token_prompts_with_tokenizer(tiny_tokenizer):
    config = DatasetConfig("random", num_prompts=20, input_len=32, output_len=8, seed=2)
    requests = sample_requests(config, tiny_tokenizer)
    special = set(tiny_tokenizer.all_special_ids)
    for r in requests:
        assert r.prompt_len == 32
        assert list(r.prompt_token_ids) == tiny_tokenizer.encode(r.prompt, add_special_tokens=False)
        assert not special & set(r.prompt_token_ids)


def test_random_range_ratio_varies_lengths():
    config = DatasetConfig("random", num_prompts=50, input_len=10, output_len=10, random_range_ratio=0.5)
    requests = sample_requests(config)
    input_lens = {len(r.prompt.split()) for r in requests}
    assert min(input_lens) >= 5 and max(input_lens) <= 15 and len(input_lens) > 1
    assert all(5 <= r.output_len <= 15 for r in requests)


def write_sharegpt(path: Path) -> str:
    data = [
        {
            "id": "a",
            "conversations": [{"from": "human", "value": "hello world"}, {"from": "gpt", "value": "t0 t1"}],
        },
        {
            "id": "b",
            "conversations": [
                {"from": "human", "value": "the quick fox"},
                {"from": "gpt", "value": "jumps over the lazy dog"},
                {"from": "human", "value": "and then"},
                {"from": "gpt", "value": "t2"},
            ],
        },
        {"id": "c", "conversations": [{"from": "human", "value": "no answer"}]},
    ]
    path.write_text(json.dumps(data))
    return str(path)


def test_sharegpt_prompts_and_reference_lengths(tmp_path, tiny_tokenizer):
    path = write_sharegpt(tmp_path / "sg.json")
    requests = sample_requests(DatasetConfig("sharegpt", num_prompts=2, dataset_path=path), tiny_tokenizer)
    by_prompt = {r.prompt: r for r in requests}
    assert set(by_prompt) == {"hello world", "the quick fox"}
    assert by_prompt["hello world"].output_len == len(
        tiny_tokenizer.encode("t0 t1", add_special_tokens=False)
    )
    fixed = sample_requests(DatasetConfig("sharegpt", num_prompts=2, dataset_path=path, output_len=9))
    assert {r.output_len for r in fixed} == {9}
    with pytest.raises(ValueError, match="needs a tokenizer"):
        sample_requests(DatasetConfig("sharegpt", num_prompts=2, dataset_path=path))
    with pytest.raises(ValueError, match="fewer than the 3 requested"):
        sample_requests(DatasetConfig("sharegpt", num_prompts=3, dataset_path=path, output_len=4))


def test_multi_turn_from_sharegpt_file(tmp_path):
    path = write_sharegpt(tmp_path / "sg.json")
    requests = sample_requests(DatasetConfig("multi-turn", num_prompts=3, dataset_path=path, output_len=4))
    turns = {}
    for r in requests:
        turns.setdefault(r.conversation_id, []).append(r.prompt)
    assert sorted(turns.values()) == [["hello world"], ["no answer"], ["the quick fox", "and then"]]


@pytest.mark.parametrize(
    "content",
    ['{"not": "a list"}', "[1, 2]", '[{"conversations": [{"from": "human"}]}]', "not json"],
)
def test_malformed_sharegpt_files_are_rejected(tmp_path, content):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=r"bad\.json"):
        sample_requests(DatasetConfig("sharegpt", num_prompts=1, dataset_path=str(path), output_len=4))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": "nope"}, "unknown dataset"),
        ({"num_prompts": 0}, "num_prompts"),
        ({"input_len": 0}, "input_len"),
        ({"prefix_len": 10}, "prefix_len does not apply to the random"),
        ({"num_turns": 2}, "num_turns does not apply"),
        ({"dataset_path": "x.json"}, "dataset_path does not apply"),
        ({"random_range_ratio": 1.0}, "random_range_ratio"),
        ({"name": "sharegpt"}, "needs a dataset_path"),
        ({"name": "sharegpt", "dataset_path": "x.json", "input_len": 5}, "input_len does not apply"),
        ({"name": "shared-prefix", "num_prompts": 3, "num_groups": 4}, "number of groups"),
        ({"name": "sharegpt", "dataset_path": "missing.json", "output_len": 3}, "does not exist"),
    ],
)
def test_dataset_config_rejects(kwargs, message):
    with pytest.raises(ValueError, match=message):
        sample_requests(DatasetConfig(**{"name": "random", "num_prompts": 4, **kwargs}))


def test_prompt_forms():
    r = BenchRequest(prompt="q", output_len=2, system_prompt="sys", conversation_id=0, turn_index=1)
    assert r.completion_prompt([("u1", "a1")]) == "sys\nu1\na1\nq"
    assert r.chat_messages([("u1", "a1")]) == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q"},
    ]
    with pytest.raises(ValueError, match="output_len"):
        BenchRequest(prompt="q", output_len=0)


# --- CLI ----------------------------------------------------------------------------------------------------------


def bench_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagoda bench")
    subparsers = parser.add_subparsers()
    cli.add_serve_parser(subparsers)
    cli.add_sweep_parser(subparsers)
    return parser


def run_cli(argv: list[str]) -> int:
    args = bench_parser().parse_args(argv)
    return args.func(args)


def test_cli_dataset_choices_match_the_datasets():
    assert cli._DATASET_CHOICES == DATASET_NAMES


def test_cli_serve_writes_a_result_file(fake, tmp_path, capsys, tiny_tokenizer_dir):
    path = tmp_path / "out.json"
    argv = ["serve", "--base-url", fake.url, "--num-prompts", "3", "--input-len", "4", "--output-len", "2"]
    argv += [
        "--result-file",
        str(path),
        "--disable-tqdm",
        "--goodput",
        "ttft:60000",
        "--tokenizer",
        tiny_tokenizer_dir,
    ]
    assert run_cli(argv) == 0
    out = capsys.readouterr().out
    assert "pagoda serving benchmark" in out and "Goodput (req/s) [ttft<=60000ms]" in out
    data = json.loads(path.read_text())
    assert data["config"]["model"] == "fake-model" and data["config"]["slos_ms"] == {"ttft": 60000.0}
    assert data["dataset"]["name"] == "random" and data["dataset"]["num_requests"] == 3
    assert data["tokenizer"] == tiny_tokenizer_dir
    # The fake server counts words, the tokenizer tokens: the server's usage wins.
    server_counts = sorted(len(body["prompt"].split()) for body in fake.bodies)
    assert sorted(r["prompt_tokens"] for r in data["requests"]) == server_counts
    assert {r["token_source"] for r in data["requests"]} == {"usage"}
    assert [r["expected_prompt_len"] for r in data["requests"]] == [4, 4, 4]


def test_cli_reads_the_api_key_from_the_environment(fake, monkeypatch, capsys):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-env")
    argv = ["serve", "--base-url", fake.url, "--model", "fake-model"]
    argv += [
        "--num-prompts",
        "1",
        "--input-len",
        "2",
        "--output-len",
        "2",
        "--disable-tqdm",
        "--endpoint",
        "chat",
    ]
    assert run_cli(argv) == 0
    assert fake.auth_headers == ["Bearer sk-env"]
    assert "no local tokenizer" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--dataset", "sharegpt"], "needs a dataset_path"),
        (["--goodput", "ttft=5"], "METRIC:MILLISECONDS"),
        (["--prefix-len", "5"], "prefix_len does not apply"),
        (["--result-file", "/nonexistent-dir/x.json"], "does not exist"),
    ],
)
def test_cli_serve_reports_bad_options(fake, capsys, extra, message):
    argv = ["serve", "--base-url", fake.url, "--model", "fake-model", "--num-prompts", "1", *extra]
    assert run_cli(argv) == 2
    assert message in capsys.readouterr().err
    assert fake.bodies == []


def test_cli_sweep_draws_a_chart_per_endpoint(fake, tmp_path, capsys):
    out = tmp_path / "sweep"
    argv = ["sweep", "--base-url", fake.url, "--base-url", fake.url + "/v1", "--label", "a", "--label", "b/2"]
    argv += ["--concurrencies", "1", "2", "--num-prompts", "4", "--input-len", "3", "--output-len", "3"]
    argv += ["--output-dir", str(out), "--disable-tqdm", "--model", "fake-model"]
    assert run_cli(argv) == 0
    assert (out / "sweep.png").read_bytes().startswith(PNG_MAGIC)
    summary = json.loads((out / "sweep.json").read_text())
    assert summary["parameter"] == "max_concurrency"
    points = [(p["label"], p["value"], p["completed"]) for p in summary["points"]]
    assert points == [("a", 1, 4), ("a", 2, 4), ("b/2", 1, 4), ("b/2", 2, 4)]
    for p in summary["points"]:
        run = json.loads(Path(p["result_file"]).read_text())
        assert run["config"]["max_concurrency"] == p["value"] and len(run["requests"]) == 4
    assert len(fake.bodies) == 16
    assert "results in" in capsys.readouterr().out


def test_cli_sweep_rejects_conflicting_options(capsys):
    argv = ["sweep", "--base-url", "http://127.0.0.1:1", "--request-rates", "1", "2", "--request-rate", "3"]
    assert run_cli(argv) == 2
    assert "conflicts" in capsys.readouterr().err
    argv = [
        "sweep",
        "--base-url",
        "http://127.0.0.1:1",
        "--label",
        "a",
        "--label",
        "b",
        "--concurrencies",
        "1",
    ]
    assert run_cli(argv) == 2
    assert "one --label per --base-url" in capsys.readouterr().err


def test_register_adds_the_bench_commands():
    pytest.importorskip(
        "pagoda.bench.offline", reason="pagoda.bench.offline (the lead's module) is not there yet"
    )
    parser = argparse.ArgumentParser(prog="pagoda")
    cli.register(parser.add_subparsers())
    for command in ("serve", "sweep", "offline"):
        with pytest.raises(SystemExit) as exit_info:
            parser.parse_args(["bench", command, "--help"])
        assert exit_info.value.code == 0


# --- sweep ----------------------------------------------------------------------------------------------------------


def test_plot_sweep_writes_a_png(tmp_path):
    def point(label, value, throughput, ttft):
        return SweepPoint(label, "request_rate", value, 10, 0, value, throughput, ttft, ttft * 2, 5.0)

    points = [point("a", 1.0, 100.0, 20.0), point("a", math.inf, 300.0, 80.0), point("b", 1.0, 90.0, 25.0)]
    points.append(SweepPoint("b", "request_rate", math.inf, 0, 10, 0.0, 0.0, None, None, None))
    plot_sweep(points, tmp_path / "chart.png")
    assert (tmp_path / "chart.png").read_bytes().startswith(PNG_MAGIC)
    with pytest.raises(ValueError, match="no sweep points"):
        plot_sweep([], tmp_path / "none.png")


def test_run_sweep_over_request_rates(fake):
    endpoints = [("fake", config_for(fake))]
    points = run_sweep(endpoints, "request_rate", [50.0, math.inf], words(3))
    assert [(p.value, p.completed, p.failed) for p in points] == [(50.0, 3, 0), (math.inf, 3, 0)]
    assert all(p.result_file is None and p.ttft_p50_ms is not None for p in points)


@pytest.mark.parametrize(
    ("parameter", "values", "labels", "message"),
    [
        ("seed", [1], ["a"], "parameter"),
        ("request_rate", [], ["a"], "at least one value"),
        ("request_rate", [1.0, 1.0], ["a"], "distinct"),
        ("request_rate", [1.0], ["a", "a"], "labels must be distinct"),
        ("request_rate", [-1.0], ["a"], "request_rate"),
    ],
)
def test_run_sweep_validates_before_running(fake, parameter, values, labels, message):
    endpoints = [(label, config_for(fake)) for label in labels]
    with pytest.raises(ValueError, match=message):
        run_sweep(endpoints, parameter, values, words(1))
    assert fake.bodies == []


# --- against a real pagoda server -----------------------------------------------------------------------------------


def test_against_a_real_pagoda_server(request, tmp_path):
    try:
        base_url = request.getfixturevalue("pagoda_server")
    except pytest.FixtureLookupError:
        pytest.skip(
            "needs the pagoda_server fixture (a running pagoda server on a tiny model), not provided yet"
        )
    model = resolve_model(base_url)
    requests = sample_requests(DatasetConfig("random", num_prompts=4, input_len=8, output_len=6, seed=1))
    for endpoint in ("completions", "chat"):
        config = ServeConfig(
            base_url, model, endpoint=endpoint, ignore_eos=True, max_concurrency=2, show_progress=False
        )
        path = tmp_path / f"{endpoint}.json"
        write_json(run_benchmark(config, requests).to_dict(), path)
        data = json.loads(path.read_text())
        summary = data["summary"]
        assert (summary["completed"], summary["failed"]) == (4, 0), summary["errors"]
        assert summary["token_count_source"] == "usage"
        for r in data["requests"]:
            # The server's usage must agree with what was asked (ignore_eos) and with what was streamed.
            assert r["output_tokens"] == 6
            assert 1 <= r["num_chunks"] <= r["output_tokens"]
            assert len(r["itl_s"]) == r["num_chunks"] - 1
            assert r["prompt_tokens"] > 0
            assert r["ttft_s"] <= r["e2el_s"]
        assert summary["total_output_tokens"] == sum(r["output_tokens"] for r in data["requests"]) == 24
        assert summary["total_input_tokens"] == sum(r["prompt_tokens"] for r in data["requests"])
