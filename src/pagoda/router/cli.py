"""`pagoda router` and `pagoda launch`. Only argparse is imported here; handlers import the rest."""

from __future__ import annotations

import argparse
from typing import Any

from pagoda.router.policies import DEFAULT_POLICY, POLICIES  # stdlib-only imports: keeps `pagoda --help` fast

_LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def _add_routing_flags(parser: argparse.ArgumentParser) -> None:
    """Flags shared by `router` and `launch`. Defaults are None: unset flags leave the config file's value."""
    parser.add_argument("--host", default=None, help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="port to listen on (default 8080)")
    parser.add_argument(
        "--policy",
        choices=sorted(POLICIES),
        default=None,
        help="routing policy within a model (default cache-aware)",
    )
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    group = parser.add_argument_group("cache-aware policy (see docs/router.md)")
    group.add_argument(
        "--cache-threshold", type=float, default=None, help="matched fraction of the prompt (0.5)"
    )
    group.add_argument("--balance-abs-threshold", type=int, default=None, help="in-flight gap max-min (16)")
    group.add_argument(
        "--balance-rel-threshold", type=float, default=None, help="in-flight ratio max/min (1.5)"
    )
    group.add_argument(
        "--max-tree-chars", type=int, default=None, help="prefix tree bound per model (8388608)"
    )
    group = parser.add_argument_group("health and timeouts")
    group.add_argument(
        "--health-interval", type=float, default=None, help="seconds between health checks (5)"
    )
    group.add_argument("--health-timeout", type=float, default=None, help="health check timeout, seconds (2)")
    group.add_argument(
        "--connect-timeout", type=float, default=None, help="backend connect timeout, seconds (5)"
    )
    group.add_argument(
        "--read-timeout",
        type=float,
        default=None,
        help="longest silence from a backend mid-response, seconds (600)",
    )
    parser.add_argument("--seed", type=int, default=None, help="random seed of the power-of-two policy")
    parser.add_argument(
        "--max-body-size",
        type=int,
        default=None,
        help="largest request body in bytes; larger get a 413 (16777216)",
    )
    parser.add_argument("--log-level", choices=_LOG_LEVELS, default="info")


def register(subparsers: Any) -> None:
    router = subparsers.add_parser(
        "router",
        help="OpenAI-compatible router in front of several engine servers",
        description="One OpenAI endpoint in front of many pagoda servers: routing by model, then by policy.",
    )
    router.add_argument("--config", default=None, help="router.yaml (see docs/router.md)")
    router.add_argument(
        "--backend",
        action="append",
        default=[],
        metavar="URL[,model=NAME]",
        help="a backend server (repeatable; added to the config file's backends); "
        "without model=, its models are read from URL/v1/models",
    )
    _add_routing_flags(router)
    router.set_defaults(func=_run_router)

    launch = subparsers.add_parser(
        "launch",
        help="start N engine replicas and a router in front of them",
        description="Start N `pagoda serve MODEL` processes on consecutive ports and a router in front; "
        "Ctrl-C (or the death of any replica) stops them all.",
    )
    launch.add_argument("model", help="model passed to `pagoda serve`")
    launch.add_argument("--replicas", type=int, required=True, help="number of engine processes")
    launch.add_argument(
        "--base-port", type=int, default=8100, help="port of the first replica (default 8100)"
    )
    launch.add_argument(
        "--serve-args", default="", help="extra arguments for every `pagoda serve`, as one quoted string"
    )
    launch.add_argument(
        "--startup-timeout", type=float, default=600.0, help="seconds to wait for the replicas' /health (600)"
    )
    _add_routing_flags(launch)
    launch.set_defaults(func=_run_launch)


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The config keys set by explicitly given flags."""
    mapping = {
        "host": "host",
        "port": "port",
        "policy": "policy",
        "api_key": "api_key",
        "health_interval": "health_interval_s",
        "health_timeout": "health_timeout_s",
        "connect_timeout": "connect_timeout_s",
        "read_timeout": "read_timeout_s",
        "seed": "seed",
        "max_body_size": "max_body_size",
    }
    overrides: dict[str, Any] = {
        key: getattr(args, flag) for flag, key in mapping.items() if getattr(args, flag) is not None
    }
    cache_aware = {
        key: getattr(args, key)
        for key in ("cache_threshold", "balance_abs_threshold", "balance_rel_threshold", "max_tree_chars")
        if getattr(args, key) is not None
    }
    if cache_aware:
        overrides["cache_aware"] = cache_aware
    return overrides


def build_router_config(args: argparse.Namespace) -> Any:
    """RouterConfig from `--config` plus flags; raises ValueError with a readable message."""
    from pagoda.router.config import config_from_mapping, parse_backend_spec, read_config_file

    data = read_config_file(args.config) if args.config else {}
    flag_backends = [parse_backend_spec(spec) for spec in args.backend]
    if flag_backends:
        file_backends = data.get("backends") or []
        if not isinstance(file_backends, list):
            raise ValueError(f"{args.config}: 'backends' must be a list")
        data["backends"] = [*file_backends, *flag_backends]
    for key, value in overrides_from_args(args).items():
        if key == "cache_aware" and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    if not data.get("backends"):
        raise ValueError("no backends: give --backend URL[,model=NAME] (repeatable) or --config router.yaml")
    return config_from_mapping(data, source=args.config or "router flags")


def _configure_logging(level: str) -> None:
    import logging

    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if level != "debug":  # httpx logs every health check at INFO
        logging.getLogger("httpx").setLevel(logging.WARNING)


def _run_router(args: argparse.Namespace) -> int:
    import sys

    try:
        config = build_router_config(args)
    except ValueError as exc:
        print(f"pagoda router: error: {exc}", file=sys.stderr)
        return 2
    _configure_logging(args.log_level)
    from pagoda.router.app import run_router

    run_router(config, log_level=args.log_level)
    return 0


def _run_launch(args: argparse.Namespace) -> int:
    import shlex
    import sys

    from pagoda.router.launch import launch_replicas

    _configure_logging(args.log_level)
    try:
        return launch_replicas(
            [args.model, *shlex.split(args.serve_args)],
            replicas=args.replicas,
            base_port=args.base_port,
            router_host=args.host or "127.0.0.1",
            router_port=args.port if args.port is not None else 8080,
            policy=args.policy or DEFAULT_POLICY,
            router_overrides={
                k: v for k, v in overrides_from_args(args).items() if k not in ("host", "port", "policy")
            },
            startup_timeout_s=args.startup_timeout,
            log_level=args.log_level,
        )
    except ValueError as exc:
        print(f"pagoda launch: error: {exc}", file=sys.stderr)
        return 2
