"""`pagoda serve / generate / chat`: help, one-line errors, flag plumbing, and in-process generation."""

from __future__ import annotations

import dataclasses
import io
import sys
import types

import pytest

from pagoda.config import EngineArgs
from pagoda.engine.llm_engine import LLMEngine
from pagoda.entrypoints import serve_cli
from pagoda.entrypoints.cli import build_parser, main
from pagoda.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(120)

SMALL = ["--dtype", "float32", "--num-kv-blocks", "64"]


def _exit_code(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)


@pytest.mark.parametrize(
    "argv", [["--help"], ["serve", "--help"], ["generate", "--help"], ["chat", "--help"]]
)
def test_help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_code(argv) == 0
    out = capsys.readouterr().out
    if argv == ["--help"]:
        assert all(name in out for name in ("serve", "generate", "chat"))
    else:
        assert "--max-model-len" in out and "--dtype" in out and "model" in out
    if argv[0] == "serve":
        for flag in (
            "--host",
            "--port",
            "--api-key",
            "--max-waiting-requests",
            "--replicas",
            "--served-model-name",
        ):
            assert flag in out


def test_bad_flags_give_a_short_error(capsys: pytest.CaptureFixture[str], tiny_llama_dir: str) -> None:
    assert _exit_code(["serve", tiny_llama_dir, "--bogus"]) == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --bogus" in err and "Traceback" not in err
    assert _exit_code(["serve", tiny_llama_dir, "--port", "eighty"]) == 2
    assert "invalid int value" in capsys.readouterr().err
    for argv, words in [
        (["serve", tiny_llama_dir, "--max-num-seqs", "0"], "max_num_seqs"),
        (["serve", "/no/such/model"], "does not exist"),
        (["serve", tiny_llama_dir, "--max-waiting-requests", "0"], "max_waiting_requests"),
        (["generate", tiny_llama_dir, "hi", "--temperature", "-1", *SMALL], "temperature"),
        (["chat", tiny_llama_dir, "--block-size", "0"], "block_size"),
    ]:
        assert _exit_code(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and words in err, err
        assert err.startswith(f"pagoda {argv[0]}: error:")


def test_engine_flag_defaults_match_engine_args(tiny_llama_dir: str) -> None:
    args = build_parser().parse_args(["serve", tiny_llama_dir])
    built = serve_cli._engine_args(args, tiny_llama_dir)
    assert built == EngineArgs(model=tiny_llama_dir)
    fields = {f.name for f in dataclasses.fields(EngineArgs)} - {"model", "limits"}
    assert set(serve_cli._ENGINE_FIELDS) == fields


def test_engine_flags_reach_engine_args(tiny_llama_dir: str) -> None:
    argv = ["serve", tiny_llama_dir, "--max-model-len", "256", "--block-size", "8", "--num-kv-blocks", "99"]
    argv += ["--no-enable-prefix-caching", "--scheduling-policy", "fcfs", "--seed", "3", "--device", "cpu"]
    built = serve_cli._engine_args(build_parser().parse_args(argv), tiny_llama_dir)
    assert (built.max_model_len, built.block_size, built.num_kv_blocks, built.enable_prefix_caching) == (
        256,
        8,
        99,
        False,
    )
    assert (built.scheduling_policy, built.seed, built.device) == ("fcfs", 3, "cpu")


def test_replicas_delegate_to_launch(monkeypatch: pytest.MonkeyPatch, tiny_llama_dir: str) -> None:
    calls = []
    import pagoda.router.launch as launch

    monkeypatch.setattr(launch, "launch_replicas", lambda *a, **kw: calls.append((a, kw)) or 0)
    argv = [
        "serve",
        tiny_llama_dir,
        "--replicas",
        "2",
        "--port",
        "9000",
        "--api-key",
        "k",
        "--block-size",
        "8",
    ]
    argv += [
        "--no-enable-prefix-caching",
        "--log-level",
        "warning",
        "--max-n",
        "7",
        "--max-body-size",
        "5000",
    ]
    assert main(argv) == 0
    ((model_args,), kw) = calls[0]
    assert kw["replicas"] == 2 and kw["router_port"] == 9000 and kw["base_port"] == 9001
    assert kw["router_overrides"] == {"api_key": "k", "max_body_size": 5000}  # the router gets the limit too
    assert model_args[0] == tiny_llama_dir and "--api-key" not in model_args and "--port" not in model_args
    # The replicas' flags give back the same engine settings.
    reparsed = build_parser().parse_args(["serve", *model_args])
    original = build_parser().parse_args(argv)
    assert serve_cli._engine_args(reparsed, tiny_llama_dir) == serve_cli._engine_args(
        original, tiny_llama_dir
    )
    assert reparsed.log_level == "warning"
    assert reparsed.max_n == 7 and reparsed.max_body_size == 5000  # limits reach the replicas
    assert serve_cli._engine_args(reparsed, tiny_llama_dir).limits.max_n == 7


def _greedy_text(model: str, prompt, max_tokens: int) -> str:
    engine = LLMEngine(EngineArgs(model=model, dtype="float32", num_kv_blocks=64))
    rid = engine.add_request(None, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    while True:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out.outputs[0].text


def test_generate_streams_the_completion(capsys: pytest.CaptureFixture[str], tiny_llama_dir: str) -> None:
    argv = ["generate", tiny_llama_dir, "Hello world", "--max-tokens", "9", "--temperature", "0", *SMALL]
    assert main(argv) == 0
    assert capsys.readouterr().out == _greedy_text(tiny_llama_dir, "Hello world", 9) + "\n"


def test_without_a_model_the_demo_model_is_used(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tiny_llama_dir: str
) -> None:
    fake = types.ModuleType("pagoda.assets")
    fake.default_model_path = lambda: tiny_llama_dir
    monkeypatch.setitem(sys.modules, "pagoda.assets", fake)
    assert main(["generate", "Hello", "--max-tokens", "3", "--temperature", "0", *SMALL]) == 0
    captured = capsys.readouterr()
    assert (
        captured.err.count("\n") == 1
        and "built-in demo model" in captured.err
        and tiny_llama_dir in captured.err
    )
    assert captured.out == _greedy_text(tiny_llama_dir, "Hello", 3) + "\n"


def test_chat_keeps_the_history(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tiny_llama_dir: str
) -> None:
    seen: list[list[dict]] = []
    original = LLMEngine.chat_prompt

    def recording(self, messages, **kw):
        seen.append([dict(m) for m in messages])
        return original(self, messages, **kw)

    monkeypatch.setattr(LLMEngine, "chat_prompt", recording)
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi there\n\n/clear\nAgain\nAnd more\n/exit\nnever read\n"))
    argv = [
        "chat",
        tiny_llama_dir,
        "--system",
        "Be brief.",
        "--max-tokens",
        "4",
        "--temperature",
        "0",
        *SMALL,
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert [[m["role"] for m in conv] for conv in seen] == [
        ["system", "user"],
        ["system", "user"],  # /clear forgot the first exchange
        ["system", "user", "assistant", "user"],
    ]
    reply = seen[2][2]
    assert reply["role"] == "assistant" and reply["content"] + "\n" in out
    assert seen[2][3] == {"role": "user", "content": "And more"}


def test_api_key_comes_from_the_flag_or_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagoda.entrypoints.openai.app import ServerConfig

    monkeypatch.delenv("PAGODA_API_KEY", raising=False)
    assert ServerConfig().resolved_api_key() is None
    monkeypatch.setenv("PAGODA_API_KEY", "from-env")
    assert ServerConfig().resolved_api_key() == "from-env"
    assert ServerConfig(api_key="flag").resolved_api_key() == "flag"
    with pytest.raises(ValueError, match="port"):
        ServerConfig(port=70000)
