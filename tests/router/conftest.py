"""Fixtures of the router tests: fake backends and routers running in threads."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fakes import Fake, ServerThread, stop_all

from pagoda.router.app import create_app
from pagoda.router.config import BackendConfig, RouterConfig


@pytest.fixture
def fakes() -> Iterator[Any]:
    started: list[Any] = []

    def make(name: str, models: list[str] | None = None) -> Fake:
        fake = Fake(name, models or ["m1"])
        started.append(fake.server)
        return fake

    yield make
    stop_all(started)


@pytest.fixture
def router() -> Iterator[Any]:
    """router(backends, **config) -> base URL of a router app running in a thread."""
    started: list[ServerThread] = []

    def make(backends: list[BackendConfig], **kwargs: Any) -> str:
        kwargs.setdefault("health_interval_s", 60.0)
        kwargs.setdefault("read_timeout_s", 10.0)
        app = create_app(RouterConfig(backends=tuple(backends), **kwargs))
        server = ServerThread(app).start()
        started.append(server)
        server.app = app  # type: ignore[attr-defined]
        return server.url

    make.servers = started  # type: ignore[attr-defined]
    yield make
    stop_all(started)
