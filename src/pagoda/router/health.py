"""Periodic health checks and model discovery.

A backend is healthy when `GET /health` answers 2xx within the timeout and it serves at least one
model: configured ones, or those listed by `GET /v1/models` (asked at every check, so a restarted
backend serving another model is noticed). One failed check takes a backend out of rotation; one
passing check puts it back.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx

from pagoda.router.backends import Backend, BackendPool

logger = logging.getLogger("pagoda.router")


class HealthChecker:
    def __init__(
        self, pool: BackendPool, client: httpx.AsyncClient, interval_s: float, timeout_s: float
    ) -> None:
        self.pool = pool
        self.client = client
        self.interval_s = interval_s
        self.timeout_s = timeout_s

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(b) for b in self.pool.backends))

    async def check(self, backend: Backend) -> bool:
        """Run one check of `backend`, update its state, and return whether it is healthy."""
        try:
            async with asyncio.timeout(self.timeout_s):
                error = await self._probe(backend)
        except TimeoutError:
            error = f"health check timed out after {self.timeout_s}s"
        except httpx.HTTPError as exc:
            error = f"health check failed: {type(exc).__name__}: {exc}"
        if error is None:
            self.pool.mark_healthy(backend)
            return True
        self.pool.mark_unhealthy(backend, error)
        return False

    async def run(self) -> None:
        """Check every backend every `interval_s` seconds, forever (cancel to stop)."""
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.check_all()
            except Exception:  # a bug in one round must not end health checking
                logger.exception("health check round failed")

    async def _probe(self, backend: Backend) -> str | None:
        """None if healthy, else why not."""
        headers = backend.auth_headers()
        response = await self.client.get(f"{backend.url}/health", headers=headers, timeout=self.timeout_s)
        if not response.is_success:
            return f"GET /health answered {response.status_code}"
        if not backend.discovers_models:
            return None
        response = await self.client.get(f"{backend.url}/v1/models", headers=headers, timeout=self.timeout_s)
        if not response.is_success:
            return f"GET /v1/models answered {response.status_code}"
        cards = _model_cards(response)
        if cards is None:
            return "GET /v1/models did not return an OpenAI model list"
        if not cards:
            return "GET /v1/models lists no models"
        self.pool.set_discovered_models(backend, cards)
        return None


def _model_cards(response: httpx.Response) -> list[dict[str, Any]] | None:
    try:
        body = response.json()
    except ValueError:
        return None
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        return None
    cards = [
        card for card in data if isinstance(card, dict) and isinstance(card.get("id"), str) and card["id"]
    ]
    return cards if len(cards) == len(data) else None
