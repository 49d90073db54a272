"""`pagoda bench serve | sweep | offline | lang | soak | perplexity`. Heavy imports wait for the handlers, so `pagoda --help` stays fast."""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagoda.cli_args import add_arguments, arg

# Kept equal to pagoda.bench.datasets.DATASET_NAMES (a test checks it) without importing that module here.
_DATASET_CHOICES = ("random", "sharegpt", "shared-prefix", "multi-turn")


def register(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser(
        "bench", help="benchmark a serving endpoint or the engine in-process", description=__doc__
    )
    bench_subparsers = bench.add_subparsers(dest="bench_command", metavar="BENCH_COMMAND")
    bench.set_defaults(func=lambda _args: _print_help(bench))
    add_serve_parser(bench_subparsers)
    add_sweep_parser(bench_subparsers)
    from pagoda.bench import lang, offline, perplexity, soak

    offline.register(bench_subparsers)
    lang.register(bench_subparsers)
    soak.register(bench_subparsers)
    perplexity.register(bench_subparsers)


def _print_help(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _rate(text: str) -> float:
    value = float(text)  # accepts "inf"
    if math.isnan(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0 or inf, got {text}")
    return value


@dataclass(frozen=True)
class DatasetArgs:
    """The dataset flags, shared by `bench serve`, `bench sweep` (mapped onto DatasetConfig). The
    per-dataset defaults of the None fields are DatasetConfig's."""

    dataset: str = arg("random", help="prompt source", choices=_DATASET_CHOICES)
    dataset_path: str | None = arg(
        None, help="ShareGPT-format JSON file (sharegpt; optional for multi-turn); never downloaded"
    )
    num_prompts: int = arg(
        200, type=_positive_int, help="number of requests; for multi-turn, of conversations"
    )
    input_len: int | None = arg(
        None,
        type=_positive_int,
        help="prompt tokens (random), question tokens after the shared prefix (shared-prefix) or tokens "
        "per user turn (multi-turn); words without a tokenizer",
        default_text="1024 for random, 128 for shared-prefix and multi-turn",
    )
    output_len: int | None = arg(
        None,
        type=_positive_int,
        help="max_tokens of each request",
        default_text="128; sharegpt: the reference answer's length",
    )
    random_range_ratio: float | None = arg(
        None,
        help="random: draw lengths uniformly within ±ratio of --input-len / --output-len",
        default_text="0",
    )
    prefix_len: int | None = arg(
        None, type=_positive_int, help="shared-prefix: tokens of each shared system prompt"
    )
    num_groups: int | None = arg(
        None, type=_positive_int, help="shared-prefix: number of shared prompts", default_text="4"
    )
    num_turns: int | None = arg(
        None, type=_positive_int, help="multi-turn: user turns per conversation", default_text="3"
    )
    seed: int = arg(0, help="seed of the prompts and the arrival times")
    tokenizer: str | None = arg(
        None,
        help="tokenizer directory; without any, prompts are random words and token counts come from the "
        "server's usage",
        default_text="--model, if available locally",
    )


@dataclass(frozen=True)
class ClientArgs:
    """How `bench serve` and `bench sweep` drive an endpoint (mapped onto ServeConfig)."""

    model: str | None = arg(None, help="model name to request", default_text="the first one /v1/models lists")
    endpoint: str = arg(
        "completions", help="/v1/completions or /v1/chat/completions", choices=("completions", "chat")
    )
    api_key: str | None = arg(None, help="bearer token", default_text="$OPENAI_API_KEY, if set")
    request_rate: float | None = arg(
        None,
        type=_rate,
        help="requests/s (multi-turn: conversations started/s), or inf to send all at once",
        default_text="inf",
    )
    burstiness: float = arg(1.0, help="shape of the gamma-distributed gaps: 1 is Poisson, lower is burstier")
    max_concurrency: int | None = arg(None, type=_positive_int, help="most requests in flight at once")
    temperature: float = arg(0.0, help="sampling temperature")
    ignore_eos: bool = arg(
        False,
        help="send ignore_eos so every request generates --output-len tokens (pagoda and vLLM accept it)",
    )
    goodput: list[str] = arg(
        default_factory=list,
        nargs="+",
        metavar="METRIC:MS",
        help="SLOs for goodput, e.g. ttft:500 tpot:50 (metrics ttft, tpot, e2el; milliseconds)",
    )
    request_timeout: float = arg(
        600.0, help="seconds to connect, or between two reads of a stream, before a request fails"
    )
    disable_tqdm: bool = arg(False, help="no progress bar")


@dataclass(frozen=True)
class ServeArgs:
    base_url: str = arg(help="server address, e.g. http://127.0.0.1:8000")
    result_file: str | None = arg(
        None, help="write the configuration, summary and every request's figures here"
    )


@dataclass(frozen=True)
class SweepArgs:
    base_url: list[str] = arg(help="server address; repeat to compare endpoints")
    label: list[str] = arg(
        default_factory=list, help="name of each --base-url in the chart (repeatable)", default_text="the URL"
    )
    output_dir: str = arg("bench-sweep", help="where result JSONs go")
    plot: str | None = arg(None, help="chart file", default_text="OUTPUT_DIR/sweep.png")


@dataclass(frozen=True)
class SweepValues:
    """What `bench sweep` varies: exactly one of these."""

    request_rates: list[float] | None = arg(
        None, type=_rate, nargs="+", help="request rates to sweep, e.g. 1 2 4 inf"
    )
    concurrencies: list[int] | None = arg(
        None, type=_positive_int, nargs="+", help="max concurrencies to sweep"
    )


def add_dataset_arguments(parser: argparse.ArgumentParser) -> None:
    """The dataset options, shared by `bench serve` and `bench sweep`."""
    add_arguments(parser.add_argument_group("dataset"), DatasetArgs)


def dataset_config_from_args(args: argparse.Namespace) -> Any:
    """A validated DatasetConfig from the options of add_dataset_arguments."""
    from pagoda.bench.datasets import DatasetConfig

    return DatasetConfig(
        name=args.dataset,
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        seed=args.seed,
        dataset_path=args.dataset_path,
        random_range_ratio=args.random_range_ratio,
        prefix_len=args.prefix_len,
        num_groups=args.num_groups,
        num_turns=args.num_turns,
    )


def load_tokenizer_from_args(args: argparse.Namespace, model: str | None) -> tuple[Any | None, str | None]:
    """(tokenizer, its name): --tokenizer, which must load, else the model's if it is available locally."""
    from pagoda.bench.datasets import load_tokenizer

    if args.tokenizer:
        return load_tokenizer(args.tokenizer), args.tokenizer
    if model:
        try:
            return load_tokenizer(model), model
        except ValueError:
            pass
    print(
        f"note: no local tokenizer for {model!r}; prompts are random words and token counts come from the "
        "server's usage (pass --tokenizer PATH for exact prompt lengths)",
        file=sys.stderr,
    )
    return None, None


def _add_client_arguments(parser: argparse.ArgumentParser) -> None:
    add_arguments(parser.add_argument_group("client"), ClientArgs)


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "serve",
        help="benchmark an OpenAI-compatible endpoint",
        description="Stream requests to an OpenAI-compatible endpoint on a Poisson (or gamma) schedule and "
        "report TTFT, TPOT, ITL, end-to-end latency, throughput and goodput.",
    )
    add_arguments(parser, ServeArgs)
    _add_client_arguments(parser)
    add_dataset_arguments(parser)
    parser.set_defaults(func=run_serve_command)
    return parser


def add_sweep_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "sweep",
        help="benchmark endpoints over several request rates or concurrencies and chart latency vs throughput",
        description="Run `bench serve` at each request rate or concurrency, for each --base-url, and draw "
        "TTFT p50/p99 and TPOT p50 against output throughput (one line per endpoint) as a PNG.",
    )
    add_arguments(parser, SweepArgs)
    add_arguments(parser.add_mutually_exclusive_group(required=True), SweepValues)
    _add_client_arguments(parser)
    add_dataset_arguments(parser)
    parser.set_defaults(func=run_sweep_command)
    return parser


def _serve_config(args: argparse.Namespace, base_url: str, model: str, api_key: str | None) -> Any:
    from pagoda.bench.metrics import parse_slos
    from pagoda.bench.serve import ServeConfig

    return ServeConfig(
        base_url=base_url,
        model=model,
        endpoint=args.endpoint,
        request_rate=math.inf if args.request_rate is None else args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        seed=args.seed,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        api_key=api_key,
        slos_ms=parse_slos(args.goodput),
        request_timeout_s=args.request_timeout,
        show_progress=not args.disable_tqdm,
    )


def _dataset_info(dataset_config: Any, requests: list) -> dict:
    from dataclasses import asdict

    return {**asdict(dataset_config), "num_requests": len(requests)}


def run_serve_command(args: argparse.Namespace) -> int:
    from pagoda.bench import serve
    from pagoda.bench.datasets import sample_requests

    try:
        api_key = args.api_key or os.environ.get("OPENAI_API_KEY") or None
        if args.result_file and not Path(args.result_file).resolve().parent.is_dir():
            raise ValueError(f"the folder of --result-file {args.result_file!r} does not exist")
        dataset_config = dataset_config_from_args(args)
        base_url = serve.normalize_base_url(args.base_url)
        model = args.model or serve.resolve_model(base_url, api_key)
        config = _serve_config(args, base_url, model, api_key)
        tokenizer, tokenizer_name = load_tokenizer_from_args(args, model)
        requests = sample_requests(dataset_config, tokenizer)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    result = serve.run_benchmark(
        config,
        requests,
        tokenizer,
        dataset=_dataset_info(dataset_config, requests),
        tokenizer_name=tokenizer_name,
    )
    print(result.format_table())
    if args.result_file:
        serve.write_json(result.to_dict(), args.result_file)
        print(f"result written to {args.result_file}")
    return 0 if result.summary.completed else 1


def run_sweep_command(args: argparse.Namespace) -> int:
    from pagoda.bench import serve
    from pagoda.bench.datasets import sample_requests
    from pagoda.bench.sweep import plot_sweep, run_sweep

    try:
        api_key = args.api_key or os.environ.get("OPENAI_API_KEY") or None
        labels = args.label or list(args.base_url)
        if len(labels) != len(args.base_url):
            raise ValueError(f"give one --label per --base-url ({len(args.base_url)}), got {len(labels)}")
        if args.request_rates is not None and args.request_rate is not None:
            raise ValueError("--request-rate conflicts with --request-rates, which sets the rate of each run")
        if args.concurrencies is not None and args.max_concurrency is not None:
            raise ValueError("--max-concurrency conflicts with --concurrencies, which sets it for each run")
        dataset_config = dataset_config_from_args(args)
        endpoints = []
        for label, url in zip(labels, args.base_url, strict=True):
            base_url = serve.normalize_base_url(url)
            model = args.model or serve.resolve_model(base_url, api_key)
            endpoints.append((label, _serve_config(args, base_url, model, api_key)))
        # One dataset for every endpoint, so that they answer the same prompts.
        tokenizer, tokenizer_name = load_tokenizer_from_args(args, endpoints[0][1].model)
        requests = sample_requests(dataset_config, tokenizer)
        parameter, values = (
            ("request_rate", args.request_rates)
            if args.request_rates is not None
            else ("max_concurrency", args.concurrencies)
        )
        points = run_sweep(
            endpoints,
            parameter,
            values,
            requests,
            tokenizer,
            output_dir=args.output_dir,
            dataset=_dataset_info(dataset_config, requests),
            tokenizer_name=tokenizer_name,
            log=print,
        )
        plot_path = args.plot or str(Path(args.output_dir) / "sweep.png")
        plot_sweep(points, plot_path)
    except (ValueError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"results in {args.output_dir}, chart in {plot_path}")
    return 0 if all(p.completed for p in points) else 1
