"""Live state of the backends: health, served models, in-flight requests."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from pagoda.router.config import BackendConfig

logger = logging.getLogger("pagoda.router")


class Backend:
    """One engine server as the router sees it. Mutated only on the router's event loop."""

    def __init__(self, config: BackendConfig) -> None:
        self.config = config
        self.url = config.url
        self.healthy = False  # until the first health check passes
        self.in_flight = 0
        self.models: frozenset[str] = frozenset(config.models)
        # Model cards as the backend reported them (discovered backends only); keyed by model id.
        self.model_cards: dict[str, dict[str, Any]] = {}
        self.last_error: str | None = None

    @property
    def discovers_models(self) -> bool:
        return not self.config.models

    def auth_headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}

    def __repr__(self) -> str:
        return f"Backend({self.url}, healthy={self.healthy}, in_flight={self.in_flight})"


class BackendPool:
    """All backends, in config order, with the transitions between healthy and unhealthy."""

    def __init__(
        self,
        configs: Sequence[BackendConfig],
        on_health_change: Callable[[Backend, bool], None] | None = None,
    ) -> None:
        self.backends = [Backend(c) for c in configs]
        self._by_url = {b.url: b for b in self.backends}
        self._on_health_change = on_health_change
        self.created = int(time.time())

    def backend(self, url: str) -> Backend:
        return self._by_url[url]

    def candidates(self, model: str) -> list[Backend]:
        return [b for b in self.backends if b.healthy and model in b.models]

    def known_models(self) -> set[str]:
        """Every model some backend serves or was configured with, healthy or not."""
        return {m for b in self.backends for m in b.models}

    def healthy_models(self) -> dict[str, dict[str, Any]]:
        """Model id -> model card, for models with at least one healthy backend (first backend wins)."""
        cards: dict[str, dict[str, Any]] = {}
        for backend in self.backends:
            if not backend.healthy:
                continue
            for model in sorted(backend.models):
                if model not in cards:
                    cards[model] = backend.model_cards.get(model) or {
                        "id": model,
                        "object": "model",
                        "created": self.created,
                        "owned_by": "pagoda",
                    }
        return cards

    def mark_healthy(self, backend: Backend) -> None:
        backend.last_error = None
        if not backend.healthy:
            backend.healthy = True
            logger.info("backend %s is healthy (models: %s)", backend.url, sorted(backend.models))
            if self._on_health_change:
                self._on_health_change(backend, True)

    def mark_unhealthy(self, backend: Backend, reason: str) -> None:
        backend.last_error = reason
        if backend.healthy:
            backend.healthy = False
            logger.warning("backend %s taken out of rotation: %s", backend.url, reason)
            if self._on_health_change:
                self._on_health_change(backend, False)

    def set_discovered_models(self, backend: Backend, cards: list[dict[str, Any]]) -> None:
        backend.model_cards = {card["id"]: card for card in cards}
        backend.models = frozenset(backend.model_cards)
