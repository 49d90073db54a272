"""`pagoda bench serve | sweep | offline | lang | soak | perplexity`. Heavy imports wait for the handlers, so `pagoda --help` stays fast."""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Any

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


def add_dataset_arguments(parser: argparse.ArgumentParser) -> None:
    """The dataset options, shared by `bench serve`, `bench sweep` and `bench offline`."""
    group = parser.add_argument_group("dataset")
    group.add_argument(
        "--dataset", choices=_DATASET_CHOICES, default="random", help="prompt source (default random)"
    )
    group.add_argument(
        "--dataset-path",
        help="ShareGPT-format JSON file (sharegpt; optional for multi-turn); never downloaded",
    )
    group.add_argument(
        "--num-prompts",
        type=_positive_int,
        default=200,
        help="number of requests; for multi-turn, of conversations (default 200)",
    )
    group.add_argument(
        "--input-len",
        type=_positive_int,
        help="prompt tokens (random, default 1024), question tokens after the shared prefix (shared-prefix, "
        "default 128) or tokens per user turn (multi-turn, default 128); words without a tokenizer",
    )
    group.add_argument(
        "--output-len",
        type=_positive_int,
        help="max_tokens of each request (default 128; sharegpt: the reference answer's length)",
    )
    group.add_argument(
        "--random-range-ratio",
        type=float,
        help="random: draw lengths uniformly within ±ratio of --input-len / --output-len (default 0)",
    )
    group.add_argument(
        "--prefix-len", type=_positive_int, help="shared-prefix: tokens of each shared system prompt"
    )
    group.add_argument(
        "--num-groups", type=_positive_int, help="shared-prefix: number of shared prompts (default 4)"
    )
    group.add_argument(
        "--num-turns", type=_positive_int, help="multi-turn: user turns per conversation (default 3)"
    )
    group.add_argument(
        "--seed", type=int, default=0, help="seed of the prompts and the arrival times (default 0)"
    )
    group.add_argument(
        "--tokenizer",
        help="tokenizer directory (default: --model, if available locally); without any, prompts are random "
        "words and token counts come from the server's usage",
    )


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
    group = parser.add_argument_group("client")
    group.add_argument("--model", help="model name to request (default: the first one /v1/models lists)")
    group.add_argument(
        "--endpoint",
        choices=("completions", "chat"),
        default="completions",
        help="/v1/completions or /v1/chat/completions",
    )
    group.add_argument("--api-key", help="bearer token (default: $OPENAI_API_KEY, if set)")
    group.add_argument(
        "--request-rate",
        type=_rate,
        help="requests/s (multi-turn: conversations started/s), or inf to send all at once (default inf)",
    )
    group.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="shape of the gamma-distributed gaps: 1 is Poisson, lower is burstier (default 1)",
    )
    group.add_argument("--max-concurrency", type=_positive_int, help="most requests in flight at once")
    group.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0)")
    group.add_argument(
        "--ignore-eos",
        action="store_true",
        help="send ignore_eos so every request generates --output-len tokens (pagoda and vLLM accept it)",
    )
    group.add_argument(
        "--goodput",
        nargs="+",
        metavar="METRIC:MS",
        default=[],
        help="SLOs for goodput, e.g. ttft:500 tpot:50 (metrics ttft, tpot, e2el; milliseconds)",
    )
    group.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="seconds to connect, or between two reads of a stream, before a request fails (default 600)",
    )
    group.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "serve",
        help="benchmark an OpenAI-compatible endpoint",
        description="Stream requests to an OpenAI-compatible endpoint on a Poisson (or gamma) schedule and "
        "report TTFT, TPOT, ITL, end-to-end latency, throughput and goodput.",
    )
    parser.add_argument("--base-url", required=True, help="server address, e.g. http://127.0.0.1:8000")
    parser.add_argument(
        "--result-file", help="write the configuration, summary and every request's figures here"
    )
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
    parser.add_argument(
        "--base-url", action="append", required=True, help="server address; repeat to compare endpoints"
    )
    parser.add_argument(
        "--label", action="append", help="name of each --base-url in the chart (default: the URL)"
    )
    values = parser.add_mutually_exclusive_group(required=True)
    values.add_argument(
        "--request-rates", nargs="+", type=_rate, help="request rates to sweep, e.g. 1 2 4 inf"
    )
    values.add_argument("--concurrencies", nargs="+", type=_positive_int, help="max concurrencies to sweep")
    parser.add_argument(
        "--output-dir", default="bench-sweep", help="where result JSONs go (default bench-sweep)"
    )
    parser.add_argument("--plot", help="chart file (default OUTPUT_DIR/sweep.png)")
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
