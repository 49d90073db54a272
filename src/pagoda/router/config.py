"""Router configuration: frozen dataclasses validated on construction, loaded from YAML or flags."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pagoda.limits import DEFAULT_MAX_BODY_SIZE
from pagoda.router.policies import DEFAULT_POLICY, POLICIES, CacheAwareConfig


@dataclass(frozen=True)
class BackendConfig:
    """One engine server. With no `models`, its models are discovered from `GET {url}/v1/models`."""

    url: str
    models: tuple[str, ...] = ()
    api_key: str | None = None  # sent to this backend as "Authorization: Bearer ..."

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not self.url:
            raise ValueError(f"backend url must be a non-empty string, got {self.url!r}")
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"backend url must look like http://HOST:PORT, got {self.url!r}")
        if parts.query or parts.fragment:
            raise ValueError(f"backend url must not have a query or fragment, got {self.url!r}")
        try:
            parts.port  # noqa: B018 - raises ValueError on a bad port
        except ValueError as exc:
            raise ValueError(f"backend url {self.url!r} has an invalid port") from exc
        object.__setattr__(self, "url", self.url.rstrip("/"))
        if isinstance(self.models, str) or not isinstance(self.models, tuple | list):
            raise ValueError(f"backend {self.url}: models must be a list of names, got {self.models!r}")
        object.__setattr__(self, "models", tuple(self.models))
        for model in self.models:
            if not isinstance(model, str) or not model:
                raise ValueError(f"backend {self.url}: model names must be non-empty strings, got {model!r}")
        if len(set(self.models)) != len(self.models):
            raise ValueError(f"backend {self.url}: duplicate model names in {list(self.models)}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ValueError(f"backend {self.url}: api_key must be a non-empty string")


def _check_positive(name: str, value: object) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")


@dataclass(frozen=True)
class RouterConfig:
    backends: tuple[BackendConfig, ...]
    policy: str = DEFAULT_POLICY
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None  # clients must send "Authorization: Bearer <api_key>" on /v1/*
    cache_aware: CacheAwareConfig = field(default_factory=CacheAwareConfig)
    health_interval_s: float = 5.0  # seconds between health checks of every backend
    health_timeout_s: float = 2.0  # a health check slower than this fails
    connect_timeout_s: float = 5.0  # connecting to a backend slower than this fails (and is retried)
    read_timeout_s: float = 600.0  # longest silence allowed between two pieces of a backend's response
    seed: int | None = None  # random seed of the power-of-two policy
    max_body_size: int = DEFAULT_MAX_BODY_SIZE  # bytes; a larger request body gets a 413

    def __post_init__(self) -> None:
        if not isinstance(self.backends, tuple | list) or not self.backends:
            raise ValueError(
                "the router needs at least one backend (--backend URL or 'backends:' in the config)"
            )
        object.__setattr__(self, "backends", tuple(self.backends))
        for backend in self.backends:
            if not isinstance(backend, BackendConfig):
                raise ValueError(f"backends must be BackendConfig objects, got {backend!r}")
        urls = [b.url for b in self.backends]
        duplicates = sorted({u for u in urls if urls.count(u) > 1})
        if duplicates:
            raise ValueError(f"duplicate backend urls: {duplicates}")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown routing policy {self.policy!r}; choose one of {sorted(POLICIES)}")
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"host must be a non-empty string, got {self.host!r}")
        if not isinstance(self.port, int) or isinstance(self.port, bool) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be an integer in [0, 65535], got {self.port!r}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ValueError("api_key must be a non-empty string")
        if not isinstance(self.cache_aware, CacheAwareConfig):
            raise ValueError(f"cache_aware must be a CacheAwareConfig, got {self.cache_aware!r}")
        for name in ("health_interval_s", "health_timeout_s", "connect_timeout_s", "read_timeout_s"):
            _check_positive(name, getattr(self, name))
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if (
            not isinstance(self.max_body_size, int)
            or isinstance(self.max_body_size, bool)
            or self.max_body_size < 1
        ):
            raise ValueError(f"max_body_size must be an integer >= 1 (bytes), got {self.max_body_size!r}")


_BACKEND_SPEC_KEYS = ("model", "api_key")


def parse_backend_spec(spec: str) -> BackendConfig:
    """Parse a `--backend` value: `URL[,model=NAME]...[,api_key=KEY]` (model may repeat)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"empty --backend value {spec!r}; expected URL[,model=NAME]")
    url, *options = (part.strip() for part in spec.split(","))
    models: list[str] = []
    api_key: str | None = None
    for option in options:
        key, sep, value = option.partition("=")
        if not sep or key not in _BACKEND_SPEC_KEYS or not value:
            raise ValueError(
                f"bad --backend option {option!r} in {spec!r}; expected URL[,model=NAME][,api_key=KEY]"
            )
        if key == "model":
            models.append(value)
        else:
            api_key = value
    return BackendConfig(url=url, models=tuple(models), api_key=api_key)


def _backend_from_yaml(entry: object, index: int) -> BackendConfig:
    where = f"backends[{index}]"
    if isinstance(entry, BackendConfig):
        return entry
    if isinstance(entry, str):
        return parse_backend_spec(entry)
    if not isinstance(entry, Mapping):
        raise ValueError(
            f"{where} must be a mapping with 'url' (or a 'URL,model=NAME' string), got {entry!r}"
        )
    unknown = set(entry) - {"url", "model", "models", "api_key"}
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}; allowed: url, model, models, api_key")
    if "url" not in entry:
        raise ValueError(f"{where}: missing 'url'")
    if "model" in entry and "models" in entry:
        raise ValueError(f"{where}: give either 'model' or 'models', not both")
    models = entry.get("models", [entry["model"]] if "model" in entry else [])
    if not isinstance(models, list):
        raise ValueError(f"{where}: 'models' must be a list, got {models!r}")
    return BackendConfig(url=entry["url"], models=tuple(models), api_key=entry.get("api_key"))


_CONFIG_KEYS = {f.name for f in dataclasses.fields(RouterConfig)}
_CACHE_AWARE_KEYS = {f.name for f in dataclasses.fields(CacheAwareConfig)}


def config_from_mapping(data: object, source: str = "router config") -> RouterConfig:
    """Build a RouterConfig from parsed YAML; errors name `source` and the offending key."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{source}: the top level must be a mapping, got {type(data).__name__}")
    unknown = set(data) - _CONFIG_KEYS
    if unknown:
        raise ValueError(f"{source}: unknown keys {sorted(unknown)}; allowed: {sorted(_CONFIG_KEYS)}")
    values: dict[str, Any] = dict(data)
    try:
        backends = values.get("backends")
        if not isinstance(backends, list) or not backends:
            raise ValueError("'backends' must be a non-empty list")
        values["backends"] = tuple(_backend_from_yaml(entry, i) for i, entry in enumerate(backends))
        if "cache_aware" in values:
            section = values["cache_aware"]
            if not isinstance(section, Mapping):
                raise ValueError(f"'cache_aware' must be a mapping, got {section!r}")
            bad = set(section) - _CACHE_AWARE_KEYS
            if bad:
                raise ValueError(
                    f"cache_aware: unknown keys {sorted(bad)}; allowed: {sorted(_CACHE_AWARE_KEYS)}"
                )
            values["cache_aware"] = CacheAwareConfig(**section)
        return RouterConfig(**values)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from exc


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Parse a router.yaml file into a mapping (validated later by `config_from_mapping`)."""
    import yaml

    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"cannot read router config {str(path)!r}: {exc.strerror}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"router config {str(path)!r} is not valid YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
    return data


def load_config(path: str | Path | None = None, overrides: Mapping[str, Any] | None = None) -> RouterConfig:
    """Read router.yaml (if given) and apply `overrides` (same keys; `cache_aware` merges key by key)."""
    data = read_config_file(path) if path is not None else {}
    for key, value in (overrides or {}).items():
        if key == "cache_aware" and isinstance(data.get(key), Mapping) and isinstance(value, Mapping):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return config_from_mapping(data, source=str(path) if path is not None else "router flags")
