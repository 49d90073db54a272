"""`pagoda serve`, `pagoda generate` and `pagoda chat`. Only argparse is imported at module level, so
`pagoda --help` stays fast; the handlers import the engine."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from pagoda.limits import (
    DEFAULT_MAX_BODY_SIZE,
    RequestLimits,
)  # stdlib-only imports: keeps `pagoda --help` fast

_LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
# Flags that map one to one onto EngineArgs fields (the dest is the field name).
_ENGINE_FIELDS = (
    "tokenizer",
    "quantization",
    "dtype",
    "device",
    "seed",
    "block_size",
    "num_kv_blocks",
    "kv_cache_memory_gb",
    "enable_prefix_caching",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "scheduling_policy",
    "enable_jump_forward",
    "jump_forward_max_running",
)


def register(subparsers: Any) -> None:
    serve = subparsers.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
        "/v1/models, /tokenize, /detokenize, /health, /metrics).",
    )
    _add_model_arg(serve)
    group = serve.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    group.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    group.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every endpoint but /health (default: $PAGODA_API_KEY)",
    )
    group.add_argument("--served-model-name", default=None, help="model name clients use (default: MODEL)")
    group.add_argument(
        "--max-waiting-requests",
        type=int,
        default=None,
        help="answer 503 while this many requests wait to be scheduled (default: no limit)",
    )
    group.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests may run on after SIGINT/SIGTERM before they are aborted (30)",
    )
    group.add_argument("--log-level", choices=_LOG_LEVELS, default="info")
    group.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="start N engine processes on ports PORT+1.. and a router on PORT in front of them",
    )
    group.add_argument(
        "--max-body-size",
        type=int,
        default=DEFAULT_MAX_BODY_SIZE,
        help=f"largest request body in bytes; larger ones get a 413 ({DEFAULT_MAX_BODY_SIZE})",
    )
    chat = serve.add_argument_group("chat")
    chat.add_argument(
        "--tool-call-parser",
        choices=("hermes", "llama3_json", "mistral", "qwen3_xml", "none"),
        default=None,
        help="how the model writes tool calls (default: chosen from the chat template; none: calls are "
        "not parsed)",
    )
    chat.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="accepted for vLLM command lines; pagoda always serves tool_choice auto when it parses calls",
    )
    chat.add_argument(
        "--reasoning-parser",
        choices=("qwen3", "deepseek_r1", "none"),
        default=None,
        help="split <think> reasoning into reasoning_content (default: when the chat template has <think>)",
    )
    chat.add_argument(
        "--default-chat-template-kwargs",
        type=_json_object,
        default=None,
        metavar="JSON",
        help="chat template variables for every request, e.g. '{\"enable_thinking\": false}' "
        "(a request's chat_template_kwargs win)",
    )
    _add_limit_args(serve)
    _add_engine_args(serve)
    serve.set_defaults(func=_run_serve)

    generate = subparsers.add_parser(
        "generate",
        help="complete one prompt in-process, streaming to the terminal",
        description="Complete PROMPT with MODEL in this process (no server) and stream the text to stdout.",
    )
    _add_model_arg(generate)
    generate.add_argument("prompt", help="the text to complete")
    _add_sampling_args(generate, max_tokens=128)
    _add_engine_args(generate)
    generate.set_defaults(func=_run_generate)

    chat = subparsers.add_parser(
        "chat",
        help="interactive chat in the terminal, in-process",
        description="Chat with MODEL in the terminal (its chat template, history kept); /exit to leave, "
        "/clear to forget the history.",
    )
    _add_model_arg(chat)
    chat.add_argument("--system", default=None, help="a system message to start the conversation with")
    _add_sampling_args(chat, max_tokens=512)
    _add_engine_args(chat)
    chat.set_defaults(func=_run_chat)


def _add_model_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        nargs="?",
        default=None,
        help="Hugging Face model folder or .gguf file (default: the built-in demo model)",
    )


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    from_defaults = _engine_defaults()
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--tokenizer", default=None, help="tokenizer folder (default: MODEL, or a GGUF file's own tokenizer)"
    )
    group.add_argument(
        "--quantization",
        choices=("q8_0", "q4_0", "q4_k"),
        default=None,
        help="quantize a safetensors model's weights at load (default: keep them as stored)",
    )
    group.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16 (default auto)")
    group.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default auto)")
    group.add_argument("--seed", type=int, default=from_defaults["seed"], help="engine random seed (0)")
    group.add_argument(
        "--block-size", type=int, default=from_defaults["block_size"], help="tokens per KV block (16)"
    )
    group.add_argument(
        "--num-kv-blocks",
        type=int,
        default=None,
        help="KV blocks to allocate (wins over --kv-cache-memory-gb)",
    )
    group.add_argument(
        "--kv-cache-memory-gb",
        type=float,
        default=from_defaults["kv_cache_memory_gb"],
        help="memory for the KV cache, GiB (1.0)",
    )
    group.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV of shared prompt prefixes (default on)",
    )
    group.add_argument(
        "--max-model-len", type=int, default=None, help="context length (default: the model's maximum)"
    )
    group.add_argument(
        "--max-num-seqs", type=int, default=from_defaults["max_num_seqs"], help="sequences per step (256)"
    )
    group.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=from_defaults["max_num_batched_tokens"],
        help="tokens per step (2048)",
    )
    group.add_argument(
        "--scheduling-policy",
        choices=("fcfs", "lpm"),
        default="lpm",
        help="fcfs or longest-prefix-match (lpm)",
    )
    group.add_argument(
        "--enable-jump-forward",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="structured output: emit forced tokens without a forward pass (default on)",
    )
    group.add_argument(
        "--jump-forward-max-running",
        type=int,
        default=None,
        help="propose jump-forward drafts only while at most this many requests run "
        "(default: 4 on the CPU, no limit elsewhere)",
    )


_LIMIT_HELP = {
    "max_n": "samples per prompt (n)",
    "max_sequences": "sequences one request adds: prompts x n",
    "max_logprobs": "logprobs / top_logprobs (at most 20, as OpenAI)",
    "max_stop": "entries of stop, and of stop_token_ids",
    "max_stop_chars": "characters of one stop string",
    "max_logit_bias": "logit_bias entries",
    "max_messages": "chat messages in one request",
    "max_prompt_chars": "prompt characters, checked before tokenizing (default: 64 x max-model-len)",
    "max_grammar_chars": "characters of a JSON schema (compact JSON), regex, grammar or all choices",
    "max_grammar_depth": "nesting of a JSON schema, or of groups in a regex or grammar",
    "grammar_compile_timeout_s": "seconds a structured-output grammar may take to compile",
}
# The flag of each RequestLimits field: the field name with dashes (the _s unit suffix dropped).
_LIMIT_FLAGS = {name: "--" + name.removesuffix("_s").replace("_", "-") for name in _LIMIT_HELP}


def _add_limit_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("request limits (a request over one gets a 400 naming it)")
    defaults = RequestLimits()
    for name, help_text in _LIMIT_HELP.items():
        default = getattr(defaults, name)
        kind = float if name.endswith("_s") else int
        shown = "" if default is None else f" ({default:g})" if kind is float else f" ({default})"
        metavar = "S" if kind is float else "N"
        group.add_argument(
            _LIMIT_FLAGS[name], dest=name, type=kind, default=default, metavar=metavar, help=help_text + shown
        )


def _request_limits(args: argparse.Namespace) -> RequestLimits:
    """The limits given on the command line (`serve`); the defaults for commands without the flags."""
    return RequestLimits(
        **{f.name: getattr(args, f.name) for f in dataclasses.fields(RequestLimits) if hasattr(args, f.name)}
    )


def _engine_defaults() -> dict[str, Any]:
    # EngineArgs imports torch; the few numeric defaults are repeated here and checked by a test.
    return {
        "seed": 0,
        "block_size": 16,
        "kv_cache_memory_gb": 1.0,
        "max_num_seqs": 256,
        "max_num_batched_tokens": 2048,
    }


def _add_sampling_args(parser: argparse.ArgumentParser, *, max_tokens: int) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument(
        "--max-tokens", type=int, default=max_tokens, help=f"tokens to generate at most ({max_tokens})"
    )
    group.add_argument("--temperature", type=float, default=0.8, help="0 for greedy (default 0.8)")
    group.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass (0.95)")
    group.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0: all (0)")
    group.add_argument(
        "--sampling-seed", type=int, default=None, help="seed of the sampler, for reproducible text"
    )
    group.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


# ---- shared helpers ---------------------------------------------------------------------------------
DEMO_MODEL_NAME = "pagoda-demo"


def _json_object(text: str) -> dict[str, Any]:
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _fail(command: str, message: str) -> int:
    print(f"pagoda {command}: error: {message}", file=sys.stderr)
    return 2


def _resolve_model(args: argparse.Namespace) -> str:
    if args.model is not None:
        return args.model
    from pagoda.assets import default_model_path

    path = str(default_model_path())
    print(f"pagoda: no model given; using the built-in demo model ({path})", file=sys.stderr)
    return path


def _engine_args(args: argparse.Namespace, model: str):
    from pagoda.config import EngineArgs

    fields = {name: getattr(args, name) for name in _ENGINE_FIELDS}
    return EngineArgs(model=model, limits=_request_limits(args), **fields)


def _sampling_params(args: argparse.Namespace):
    from pagoda.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sampling_seed,
        stop=args.stop,
    )


def _configure_logging(level: str) -> None:
    import logging

    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


# ---- serve ------------------------------------------------------------------------------------------
def _run_serve(args: argparse.Namespace) -> int:
    try:
        model = _resolve_model(args)
        engine_args = _engine_args(args, model)
        from pagoda.entrypoints.openai.app import ServerConfig

        config = ServerConfig(
            host=args.host,
            port=args.port,
            api_key=args.api_key,
            # The demo model is served under a short name rather than its install path.
            served_model_name=args.served_model_name or (DEMO_MODEL_NAME if args.model is None else None),
            max_waiting_requests=args.max_waiting_requests,
            shutdown_timeout_s=args.shutdown_timeout,
            log_level=args.log_level,
            max_body_size=args.max_body_size,
            tool_call_parser=args.tool_call_parser,
            reasoning_parser=args.reasoning_parser,
            default_chat_template_kwargs=args.default_chat_template_kwargs or {},
        )
    except (ValueError, OSError, ImportError) as exc:
        return _fail("serve", str(exc))
    _configure_logging(args.log_level)
    if args.replicas is not None:
        return _launch_replicas(args, model, config)
    from pagoda.entrypoints.openai.app import run_server
    from pagoda.kernels import build as cpu_kernels

    try:
        cpu_kernels.available()  # logs the CPU kernel variant, or why the PyTorch path is used
        return run_server(engine_args, config)
    except ValueError as exc:  # e.g. a model folder that does not load
        return _fail("serve", str(exc))


def _launch_replicas(args: argparse.Namespace, model: str, config: Any) -> int:
    from pagoda.router.launch import launch_replicas

    if args.replicas < 1:
        return _fail("serve", f"--replicas must be >= 1, got {args.replicas}")
    api_key = config.resolved_api_key()
    try:
        return launch_replicas(
            [model, *_replica_flags(args)],
            replicas=args.replicas,
            base_port=args.port + 1,
            router_host=args.host,
            router_port=args.port,
            router_overrides={
                "max_body_size": args.max_body_size,
                **({"api_key": api_key} if api_key else {}),
            },
            log_level=args.log_level,
        )
    except ValueError as exc:
        return _fail("serve", str(exc))


def _replica_flags(args: argparse.Namespace) -> list[str]:
    """`pagoda serve` flags that give each replica this command's engine settings (the router in
    front checks the API key; the replicas listen on loopback ports without one)."""
    import json

    flags: list[str] = []
    names = [
        *_ENGINE_FIELDS,
        "served_model_name",
        "max_waiting_requests",
        "shutdown_timeout",
        "log_level",
        "tool_call_parser",
        "reasoning_parser",
    ]
    names += ["max_body_size", *_LIMIT_FLAGS]
    for name in names:
        value = getattr(args, name)
        flag = _LIMIT_FLAGS.get(name) or "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        elif value is not None:
            flags += [flag, str(value)]
    if args.enable_auto_tool_choice:
        flags.append("--enable-auto-tool-choice")
    if args.default_chat_template_kwargs:
        flags += ["--default-chat-template-kwargs", json.dumps(args.default_chat_template_kwargs)]
    return flags


# ---- generate and chat (in-process) -----------------------------------------------------------------
def _load_engine(command: str, args: argparse.Namespace):
    """(engine, params) or raises SystemExit with a one-line error."""
    try:
        model = _resolve_model(args)
        params = _sampling_params(args)
        from pagoda.engine.llm_engine import LLMEngine

        return LLMEngine(_engine_args(args, model)), params
    except (ValueError, OSError, ImportError) as exc:
        raise SystemExit(_fail(command, str(exc))) from None


def _stream_reply(engine, prompt, params) -> str:
    """Generate for one prompt, printing the text as it comes; returns the whole text. Ctrl-C aborts."""
    request_id = engine.add_request(None, prompt, params, stream=True)
    pieces: list[str] = []
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                for c in out.outputs:
                    pieces.append(c.text)
                    sys.stdout.write(c.text)
                    sys.stdout.flush()
    except KeyboardInterrupt:
        engine.abort_request([request_id])
        sys.stdout.write(" [interrupted]")
    sys.stdout.write("\n")
    sys.stdout.flush()
    return "".join(pieces)


def _run_generate(args: argparse.Namespace) -> int:
    engine, params = _load_engine("generate", args)
    try:
        _stream_reply(engine, args.prompt, params)
    except ValueError as exc:
        return _fail("generate", str(exc))
    return 0


def _run_chat(args: argparse.Namespace) -> int:
    engine, params = _load_engine("chat", args)
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict[str, str]] = list(system)
    interactive = sys.stdin.isatty()
    if interactive:
        print("Chatting with the model; /exit to leave, /clear to forget the history.", file=sys.stderr)
    while True:
        try:
            line = input(">>> " if interactive else "")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        text = line.strip()
        if text in ("/exit", "/bye", "/quit"):
            return 0
        if text == "/clear":
            history = list(system)
            continue
        if not text:
            continue
        turn = [*history, {"role": "user", "content": text}]
        try:
            prompt = engine.chat_prompt(turn)
            reply = _stream_reply(engine, prompt, params)
        except ValueError as exc:
            print(f"error: {exc} (/clear forgets the history)", file=sys.stderr)
            continue
        history = [*turn, {"role": "assistant", "content": reply}]
