"""`pagoda serve`, `pagoda generate` and `pagoda chat`. Their flags are generated from the fields of
EngineArgs, ServerArgs and the dataclasses below. Only argparse and those (stdlib-only) dataclasses
are imported at module level, so `pagoda --help` stays fast; the handlers import the engine."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass
from typing import Any

from pagoda.cli_args import add_arguments, arg, to_argv, values_from
from pagoda.config import EngineArgs
from pagoda.entrypoints.server_args import ServerArgs
from pagoda.limits import RequestLimits

# ServerArgs fields that a replica started by --replicas does not inherit: the router in front
# listens on them and checks the API key; the replicas listen on loopback ports without one.
_ROUTER_OWNED = ("host", "port", "api_key", "replicas")


@dataclass(frozen=True)
class SamplingArgs:
    """The sampling flags of `pagoda generate` and `pagoda chat` (mapped onto SamplingParams)."""

    max_tokens: int = arg(128, help="tokens to generate at most (fewer where the context ends)")
    temperature: float = arg(0.8, help="0 for greedy")
    top_p: float = arg(0.95, help="nucleus sampling mass")
    top_k: int = arg(0, help="keep the k most likely tokens; 0: all")
    sampling_seed: int | None = arg(None, help="seed of the sampler, for reproducible text")
    stop: list[str] = arg(default_factory=list, help="stop string (repeatable)")

    def sampling_params(self):
        from pagoda.sampling_params import SamplingParams

        return SamplingParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.sampling_seed,
            stop=list(self.stop) or None,
        )


@dataclass(frozen=True)
class ChatArgs:
    system: str | None = arg(None, help="a system message to start the conversation with")


def register(subparsers: Any) -> None:
    serve = subparsers.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
        "/v1/models, /tokenize, /detokenize, /health, /metrics).",
    )
    _add_model_arg(serve)
    add_arguments(serve.add_argument_group("server"), ServerArgs)
    add_arguments(
        serve.add_argument_group("request limits (a request over one gets a 400 naming it)"), RequestLimits
    )
    _add_engine_args(serve)
    serve.set_defaults(func=_run_serve)

    generate = subparsers.add_parser(
        "generate",
        help="complete one prompt in-process, streaming to the terminal",
        description="Complete PROMPT with MODEL in this process (no server) and stream the text to stdout.",
    )
    _add_model_arg(generate)
    generate.add_argument("prompt", help="the text to complete")
    add_arguments(generate.add_argument_group("sampling"), SamplingArgs)
    _add_engine_args(generate)
    generate.set_defaults(func=_run_generate)

    chat = subparsers.add_parser(
        "chat",
        help="interactive chat in the terminal, in-process",
        description="Chat with MODEL in the terminal (its chat template, history kept); /exit to leave, "
        "/clear to forget the history.",
    )
    _add_model_arg(chat)
    add_arguments(chat, ChatArgs)
    add_arguments(chat.add_argument_group("sampling"), SamplingArgs, defaults={"max_tokens": 512})
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
    add_arguments(parser.add_argument_group("engine"), EngineArgs)


# ---- shared helpers ---------------------------------------------------------------------------------
DEMO_MODEL_NAME = "pagoda-demo"


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


def _engine_args(args: argparse.Namespace, model: str) -> EngineArgs:
    """EngineArgs from the engine flags, and the request limits from theirs (`serve`; the
    defaults for commands without them)."""
    limits = RequestLimits(**values_from(RequestLimits, args))
    return EngineArgs(**values_from(EngineArgs, args, model=model, limits=limits))


def _server_args(args: argparse.Namespace) -> ServerArgs:
    # The demo model is served under a short name rather than its install path.
    served_name = args.served_model_name or (DEMO_MODEL_NAME if args.model is None else None)
    return ServerArgs(**values_from(ServerArgs, args, served_model_name=served_name))


def _sampling_params(args: argparse.Namespace):
    return SamplingArgs(**values_from(SamplingArgs, args)).sampling_params()


def _configure_logging(level: str) -> None:
    import logging

    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


# ---- serve ------------------------------------------------------------------------------------------
def _run_serve(args: argparse.Namespace) -> int:
    try:
        model = _resolve_model(args)
        engine_args = _engine_args(args, model)
        config = _server_args(args)
    except (ValueError, OSError, ImportError) as exc:
        return _fail("serve", str(exc))
    _configure_logging(config.log_level)
    if engine_args.headless:
        return _run_headless(engine_args)
    if config.replicas is not None:
        if engine_args.nnodes > 1:
            return _fail("serve", "--replicas runs on one node; it cannot be combined with --nnodes > 1")
        return _launch_replicas(engine_args, config)
    from pagoda.entrypoints.openai.app import run_server
    from pagoda.kernels import build as cpu_kernels

    try:
        cpu_kernels.available()  # logs the CPU kernel variant, or why the PyTorch path is used
        return run_server(engine_args, config)
    except ValueError as exc:  # e.g. a model folder that does not load
        return _fail("serve", str(exc))


def _run_headless(engine_args: EngineArgs) -> int:
    """A node other than 0 of a tensor-parallel group: its ranks join node 0's, load their shards
    and run what node 0's engine broadcasts, until it shuts down (exit 0) or a rank fails (1)."""
    from pagoda.engine.resolve import resolve_device
    from pagoda.worker.executor import run_headless

    parallel = engine_args.parallel_config()
    print(
        f"pagoda serve: headless node {parallel.node_rank} of {parallel.nnodes}: ranks "
        f"{parallel.global_rank(0)}..{parallel.global_rank(parallel.local_size - 1)} of "
        f"{parallel.tensor_parallel_size}, joining {parallel.master_addr}:{parallel.master_port}",
        file=sys.stderr,
    )
    try:
        return run_headless(parallel, engine_args.model, resolve_device(engine_args.device).type)
    except ValueError as exc:
        return _fail("serve", str(exc))


def _launch_replicas(engine_args: EngineArgs, config: ServerArgs) -> int:
    from pagoda.router.launch import launch_replicas

    api_key = config.resolved_api_key()
    try:
        return launch_replicas(
            [engine_args.model, *_replica_flags(engine_args, config)],
            replicas=config.replicas,
            base_port=config.port + 1,
            router_host=config.host,
            router_port=config.port,
            router_overrides={
                "max_body_size": config.max_body_size,
                **({"api_key": api_key} if api_key else {}),
            },
            log_level=config.log_level,
        )
    except ValueError as exc:
        return _fail("serve", str(exc))


def _replica_flags(engine_args: EngineArgs, config: ServerArgs) -> list[str]:
    """`pagoda serve` flags that give each replica this command's engine and server settings,
    but for those the router owns."""
    server = {name: v for name, v in dataclasses.asdict(config).items() if name not in _ROUTER_OWNED}
    return (
        to_argv(EngineArgs, dataclasses.asdict(engine_args))
        + to_argv(RequestLimits, dataclasses.asdict(engine_args.limits))
        + to_argv(ServerArgs, server)
    )


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
    """Generate for one prompt, printing the text as it comes; returns the whole text. Ctrl-C aborts.
    In the terminal --max-tokens is a bound: a reply also ends where the context is full (LLM and
    the server reject a max_tokens beyond the context instead)."""
    num_prompt = len(prompt) if isinstance(prompt, list) else len(engine.tokenizer(prompt)["input_ids"])
    room = engine.max_model_len - num_prompt
    if 0 < room < params.max_tokens:
        params = dataclasses.replace(params, max_tokens=room)
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
    finally:
        engine.shutdown()  # the tensor-parallel ranks, if any
    return 0


def _run_chat(args: argparse.Namespace) -> int:
    engine, params = _load_engine("chat", args)
    try:
        return _chat_loop(engine, params, args)
    finally:
        engine.shutdown()  # the tensor-parallel ranks, if any


def _chat_loop(engine, params, args: argparse.Namespace) -> int:
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
