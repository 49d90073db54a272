"""`pagoda router` and `pagoda launch`. Only argparse and stdlib-only config modules are imported here; handlers import the rest."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from pagoda.cli_args import add_arguments, arg, field_default
from pagoda.router.config import RouterConfig  # stdlib-only imports: keeps `pagoda --help` fast
from pagoda.router.policies import POLICIES, CacheAwareConfig

_LOG_LEVELS = ("critical", "error", "warning", "info", "debug")

# RoutingArgs field -> the RouterConfig key it overrides ("cache_aware." keys: of that section).
_CONFIG_KEYS = {
    "host": "host",
    "port": "port",
    "policy": "policy",
    "api_key": "api_key",
    "cache_threshold": "cache_aware.cache_threshold",
    "balance_abs_threshold": "cache_aware.balance_abs_threshold",
    "balance_rel_threshold": "cache_aware.balance_rel_threshold",
    "max_tree_chars": "cache_aware.max_tree_chars",
    "health_interval": "health_interval_s",
    "health_timeout": "health_timeout_s",
    "connect_timeout": "connect_timeout_s",
    "read_timeout": "read_timeout_s",
    "seed": "seed",
    "max_body_size": "max_body_size",
}


def _config_default(field_name: str) -> Any:
    """The RouterConfig default of the key a flag overrides."""
    section, _, key = _CONFIG_KEYS[field_name].rpartition(".")
    cls = CacheAwareConfig if section else RouterConfig
    return field_default(cls.__dataclass_fields__[key])


def _help_default(field_name: str) -> str:
    return str(_config_default(field_name))


@dataclass(frozen=True)
class RoutingArgs:
    """Flags shared by `router` and `launch`. Defaults are None: a flag not given leaves the config
    file's value, or RouterConfig's default (shown in the help)."""

    host: str | None = arg(None, help="address to listen on", default_text=_help_default("host"))
    port: int | None = arg(None, help="port to listen on", default_text=_help_default("port"))
    policy: str | None = arg(
        None,
        help="routing policy within a model",
        choices=sorted(POLICIES),
        default_text=_help_default("policy"),
    )
    api_key: str | None = arg(None, help="require 'Authorization: Bearer KEY' on /v1/*")
    seed: int | None = arg(None, help="random seed of the power-of-two policy")
    max_body_size: int | None = arg(
        None,
        help="largest request body in bytes; larger get a 413",
        default_text=_help_default("max_body_size"),
        metavar="BYTES",
    )
    log_level: str = arg("info", help="log level", choices=_LOG_LEVELS)


@dataclass(frozen=True)
class CacheAwareArgs:
    cache_threshold: float | None = arg(
        None, help="matched fraction of the prompt", default_text=_help_default("cache_threshold")
    )
    balance_abs_threshold: int | None = arg(
        None, help="in-flight gap max-min", default_text=_help_default("balance_abs_threshold")
    )
    balance_rel_threshold: float | None = arg(
        None, help="in-flight ratio max/min", default_text=_help_default("balance_rel_threshold")
    )
    max_tree_chars: int | None = arg(
        None, help="prefix tree bound per model", default_text=_help_default("max_tree_chars")
    )


@dataclass(frozen=True)
class HealthArgs:
    health_interval: float | None = arg(
        None, help="seconds between health checks", default_text=_help_default("health_interval")
    )
    health_timeout: float | None = arg(
        None, help="health check timeout, seconds", default_text=_help_default("health_timeout")
    )
    connect_timeout: float | None = arg(
        None, help="backend connect timeout, seconds", default_text=_help_default("connect_timeout")
    )
    read_timeout: float | None = arg(
        None,
        help="longest silence from a backend mid-response, seconds",
        default_text=_help_default("read_timeout"),
    )


@dataclass(frozen=True)
class RouterArgs:
    config: str | None = arg(None, help="router.yaml (see docs/router.md)")
    backend: list[str] = arg(
        default_factory=list,
        metavar="URL[,model=NAME]",
        help="a backend server (repeatable; added to the config file's backends); "
        "without model=, its models are read from URL/v1/models",
    )


@dataclass(frozen=True)
class LaunchArgs:
    replicas: int = arg(help="number of engine processes")
    base_port: int = arg(8100, help="port of the first replica")
    serve_args: str = arg("", help="extra arguments for every `pagoda serve`, as one quoted string")
    startup_timeout: float = arg(600.0, help="seconds to wait for the replicas' /health")


def _add_routing_flags(parser: argparse.ArgumentParser) -> None:
    add_arguments(parser, RoutingArgs)
    add_arguments(parser.add_argument_group("cache-aware policy (see docs/router.md)"), CacheAwareArgs)
    add_arguments(parser.add_argument_group("health and timeouts"), HealthArgs)


def register(subparsers: Any) -> None:
    router = subparsers.add_parser(
        "router",
        help="OpenAI-compatible router in front of several engine servers",
        description="One OpenAI endpoint in front of many pagoda servers: routing by model, then by policy.",
    )
    add_arguments(router, RouterArgs)
    _add_routing_flags(router)
    router.set_defaults(func=_run_router)

    launch = subparsers.add_parser(
        "launch",
        help="start N engine replicas and a router in front of them",
        description="Start N `pagoda serve MODEL` processes on consecutive ports and a router in front; "
        "Ctrl-C (or the death of any replica) stops them all.",
    )
    launch.add_argument("model", help="model passed to `pagoda serve`")
    add_arguments(launch, LaunchArgs)
    _add_routing_flags(launch)
    launch.set_defaults(func=_run_launch)


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The config keys set by explicitly given flags (nested sections as dicts)."""
    overrides: dict[str, Any] = {}
    for flag, key in _CONFIG_KEYS.items():
        value = getattr(args, flag)
        if value is None:
            continue
        section, _, name = key.rpartition(".")
        (overrides.setdefault(section, {}) if section else overrides)[name] = value
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
            router_host=args.host or _config_default("host"),
            router_port=args.port if args.port is not None else _config_default("port"),
            policy=args.policy or _config_default("policy"),
            router_overrides={
                k: v for k, v in overrides_from_args(args).items() if k not in ("host", "port", "policy")
            },
            startup_timeout_s=args.startup_timeout,
            log_level=args.log_level,
        )
    except ValueError as exc:
        print(f"pagoda launch: error: {exc}", file=sys.stderr)
        return 2
