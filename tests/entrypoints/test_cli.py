"""`pagoda serve / generate / chat`: help, one-line errors, flag plumbing, and in-process generation."""

from __future__ import annotations

import argparse
import dataclasses
import io
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from pagoda.cli_args import field_default, flag_fields, values_from
from pagoda.config import EngineArgs
from pagoda.engine.llm_engine import LLMEngine
from pagoda.entrypoints import serve_cli
from pagoda.entrypoints.cli import build_parser, main
from pagoda.entrypoints.server_args import ServerArgs
from pagoda.limits import RequestLimits
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
    assert ServerArgs(**values_from(ServerArgs, args)) == ServerArgs()


def _actions(argv: list[str]) -> dict[str, argparse.Action]:
    """The subcommand parser's actions by dest."""
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    sub = subparsers.choices[argv[0]]
    for name in argv[1:]:
        sub = next(a for a in sub._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
    return {a.dest: a for a in sub._actions}


def _commands() -> list[tuple[list[str], tuple[type, ...]]]:
    from pagoda.bench import cli as bench_cli
    from pagoda.bench.lang import LangBenchArgs
    from pagoda.bench.offline import OfflineArgs
    from pagoda.bench.soak import SoakConfig, SoakOutput
    from pagoda.router import cli as router_cli

    routing = (router_cli.RoutingArgs, router_cli.CacheAwareArgs, router_cli.HealthArgs)
    client = (bench_cli.ClientArgs, bench_cli.DatasetArgs)
    return [
        (["serve"], (EngineArgs, ServerArgs, RequestLimits)),
        (["generate"], (EngineArgs, serve_cli.SamplingArgs)),
        (["chat"], (EngineArgs, serve_cli.SamplingArgs, serve_cli.ChatArgs)),
        (["bench", "serve"], (bench_cli.ServeArgs, *client)),
        (["bench", "sweep"], (bench_cli.SweepArgs, bench_cli.SweepValues, *client)),
        (["bench", "offline"], (OfflineArgs,)),
        (["bench", "lang"], (LangBenchArgs,)),
        (["bench", "soak"], (SoakConfig, SoakOutput)),
        (["router"], (router_cli.RouterArgs, *routing)),
        (["launch"], (router_cli.LaunchArgs, *routing)),
    ]


# Fields that are not flags: EngineArgs.model is the positional MODEL argument, EngineArgs.limits a
# RequestLimits whose own fields are the flags (serve only); the soak's timeouts are fixed.
NOT_FLAGS = {"EngineArgs": {"model", "limits"}, "SoakConfig": {"idle_timeout_s", "request_timeout_s"}}


@pytest.mark.parametrize(
    ("command", "classes"), _commands(), ids=lambda c: "-".join(c) if c and isinstance(c[0], str) else None
)
def test_every_field_is_a_flag_with_its_default_and_help(
    command: list[str], classes: tuple[type, ...]
) -> None:
    actions = _actions(command)
    overrides = {"chat": {"max_tokens": 512}}.get(command[0], {})
    for cls in classes:
        declared = {f.name for f, _, _ in flag_fields(cls)}
        assert declared == {f.name for f in dataclasses.fields(cls)} - NOT_FLAGS.get(cls.__name__, set()), cls
        for f, spec, _ in flag_fields(cls):
            action = actions[f.name]
            assert action.option_strings[0] == "--" + f.name.replace("_", "-")
            default = overrides.get(f.name, field_default(f))
            if default is not dataclasses.MISSING:
                assert action.default == default, f.name
            assert action.help.startswith(spec.help.replace("%", "%%")), f.name
            shown = spec.default_text or (
                ("on" if default else "off") if isinstance(default, bool) else default
            )
            if shown not in (None, [], "", {}, dataclasses.MISSING):
                assert action.help.endswith(f"(default: {shown})"), (f.name, action.help)


def test_flag_names_stay_as_they_were() -> None:
    """The public flags of serve (the names before they were generated; new ones may be added)."""
    serve = {s for a in _actions(["serve"]).values() for s in a.option_strings}
    assert serve >= {
        "--host", "--port", "--api-key", "--served-model-name", "--max-waiting-requests", "--shutdown-timeout",
        "--log-level", "--replicas", "--tokenizer", "--dtype", "--device", "--seed", "--block-size",
        "--num-kv-blocks", "--kv-cache-memory-gb", "--enable-prefix-caching", "--no-enable-prefix-caching",
        "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens", "--scheduling-policy",
        "--enable-jump-forward", "--no-enable-jump-forward", "--jump-forward-max-running",
    }  # fmt: skip
    generate = {s for a in _actions(["generate"]).values() for s in a.option_strings}
    assert generate >= {"--max-tokens", "--temperature", "--top-p", "--top-k", "--sampling-seed", "--stop"}
    assert "--system" in {s for a in _actions(["chat"]).values() for s in a.option_strings}


def _numeric_flags() -> list[str]:
    flags = []
    for cls in (EngineArgs, ServerArgs):
        for f, spec, hint in flag_fields(cls):
            if spec.choices is None and ("int" in str(hint) or "float" in str(hint)):
                flags.append("--" + f.name.replace("_", "-"))
    return flags


@pytest.mark.parametrize("flag", _numeric_flags())
def test_a_value_that_does_not_parse_is_an_argparse_error_naming_the_flag(
    flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _exit_code(["serve", "some-model", flag, "many"]) == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: invalid" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["serve", "m", "--scheduling-policy", "random"], "--scheduling-policy"),
        (["serve", "m", "--dtype", "float64"], "--dtype"),
        (["serve", "m", "--log-level", "loud"], "--log-level"),
        (["chat", "m", "--top-k", "1.5"], "--top-k"),
        (["bench", "offline", "--dtype", "auto"], "--dtype"),
        (["bench", "serve", "--base-url", "http://x", "--num-prompts", "0"], "--num-prompts"),
        (["launch", "m", "--replicas", "two"], "--replicas"),
        (["router", "--cache-threshold", "half"], "--cache-threshold"),
    ],
)
def test_bad_choices_and_types_are_argparse_errors(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _exit_code(argv) == 2
    assert f"argument {flag}:" in capsys.readouterr().err


def test_bench_offline_engine_flags_come_from_engine_args() -> None:
    from pagoda.bench.offline import OFFLINE_ENGINE_DEFAULTS, OFFLINE_ENGINE_FLAGS

    actions = _actions(["bench", "offline"])
    for f, spec, _ in flag_fields(EngineArgs):
        if f.name in OFFLINE_ENGINE_FLAGS:
            assert actions[f.name].help.startswith(spec.help)
            assert actions[f.name].default == OFFLINE_ENGINE_DEFAULTS.get(f.name, field_default(f))
    args = build_parser().parse_args(["bench", "offline", "--max-num-seqs", "8", "--no-baseline"])
    assert (args.max_num_seqs, args.dtype, args.kv_cache_memory_gb, args.baseline) == (
        8,
        "bfloat16",
        2.0,
        "none",
    )
    assert build_parser().parse_args(["bench", "offline", "--baseline", "llama.cpp"]).baseline == "llama.cpp"


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


def test_in_the_terminal_max_tokens_is_bounded_by_the_context(
    capsys: pytest.CaptureFixture[str], tiny_llama_dir: str
) -> None:
    argv = ["generate", tiny_llama_dir, "Hello world", "--max-tokens", "100", "--temperature", "0"]
    assert main([*argv, "--max-model-len", "16", *SMALL]) == 0
    engine = LLMEngine(EngineArgs(model=tiny_llama_dir, dtype="float32", num_kv_blocks=64, max_model_len=16))
    engine.add_request(None, "Hello world", SamplingParams(temperature=0.0, max_tokens=None))
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
    assert final.finished and final.outputs[0].finish_reason == "length"
    assert capsys.readouterr().out == final.outputs[0].text + "\n"


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
    monkeypatch.delenv("PAGODA_API_KEY", raising=False)
    assert ServerArgs().resolved_api_key() is None
    monkeypatch.setenv("PAGODA_API_KEY", "from-env")
    assert ServerArgs().resolved_api_key() == "from-env"
    assert ServerArgs(api_key="flag").resolved_api_key() == "flag"
    with pytest.raises(ValueError, match="port"):
        ServerArgs(port=70000)
    with pytest.raises(ValueError, match="replicas"):
        ServerArgs(replicas=0)
    for bad in (0, -1.0, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="timeout_keep_alive"):
            ServerArgs(timeout_keep_alive=bad)
    assert ServerArgs(timeout_keep_alive=2.5).timeout_keep_alive == 2.5


def test_building_the_parser_imports_no_engine() -> None:
    """`pagoda --help` stays fast: the flags come from stdlib-only dataclasses."""
    code = (
        "import sys; from pagoda.entrypoints.cli import build_parser; build_parser(); "
        "heavy = ('torch', 'transformers', 'xgrammar', 'fastapi', 'uvicorn', 'httpx', 'numpy', 'yaml'); "
        "print([m for m in heavy if m in sys.modules])"
    )
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_parser_choices_match_the_parsers() -> None:
    from pagoda.entrypoints import server_args
    from pagoda.entrypoints.openai.reasoning import REASONING_PARSERS
    from pagoda.entrypoints.openai.tool_parsers import TOOL_PARSERS

    assert (*TOOL_PARSERS, "none") == server_args.TOOL_CALL_PARSERS
    assert (*REASONING_PARSERS, "none") == server_args.REASONING_PARSERS
    with pytest.raises(ValueError, match="tool call parser"):
        ServerArgs(tool_call_parser="xml")
