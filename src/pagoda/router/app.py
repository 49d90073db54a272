"""The router's FastAPI app: OpenAI endpoints proxied to backends, plus /health and /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import secrets
import uuid
from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagoda import http_client
from pagoda.http_body import BodySizeLimit
from pagoda.limits import DEFAULT_KEEP_ALIVE_S
from pagoda.router.backends import Backend, BackendPool
from pagoda.router.config import RouterConfig
from pagoda.router.errors import error_response
from pagoda.router.health import HealthChecker
from pagoda.router.metrics import RouterMetrics
from pagoda.router.policies import make_policy
from pagoda.router.proxy import Proxy

logger = logging.getLogger("pagoda.router")

# A client's own x-request-id is kept if it looks like an id; anything else is replaced by a fresh one.
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


def request_id_of(request: Request) -> str:
    given = request.headers.get("x-request-id")
    if given and _REQUEST_ID.fullmatch(given):
        return given
    return uuid.uuid4().hex


class RouterState:
    """Everything one router instance owns; reachable as `app.state.router` (tests look inside)."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.metrics = RouterMetrics()
        self.policy = make_policy(config.policy, config.cache_aware, config.seed)
        self.pool = BackendPool(config.backends, on_health_change=self._on_health_change)
        for backend in self.pool.backends:
            self.metrics.healthy.labels(backend.url).set(0)
            self.metrics.in_flight.labels(backend.url).set(0)
        self.proxy = Proxy(self.pool, self.policy, self.metrics, config.api_key)
        self.health: HealthChecker | None = None

    def _on_health_change(self, backend: Backend, healthy: bool) -> None:
        self.metrics.healthy.labels(backend.url).set(1 if healthy else 0)
        if not healthy:
            self.metrics.failovers.labels(backend.url).inc()
            # Its cache is unknown from now on (it may restart empty): forget what was sent there.
            self.policy.forget_backend(backend.url)

    def make_client(self) -> httpx.AsyncClient:
        c = self.config
        # Never through an environment-configured proxy; a backend's stale keep-alive connection is
        # resent on a fresh one instead of failing the request (and the backend's health).
        return http_client.async_client(
            timeout=httpx.Timeout(
                connect=c.connect_timeout_s,
                read=c.read_timeout_s,
                write=c.read_timeout_s,
                pool=c.connect_timeout_s,
            )
        )


def create_app(config: RouterConfig) -> FastAPI:
    state = RouterState(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with state.make_client() as client:
            state.proxy.client = client
            state.health = HealthChecker(
                state.pool, client, config.health_interval_s, config.health_timeout_s
            )
            await state.health.check_all()
            for backend in state.pool.backends:
                if not backend.healthy:
                    logger.warning(
                        "backend %s is not healthy at startup: %s", backend.url, backend.last_error
                    )
            task = asyncio.create_task(state.health.run(), name="pagoda-router-health")
            try:
                yield
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                state.proxy.client = None

    app = FastAPI(
        title="pagoda router",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.add_middleware(BodySizeLimit, max_bytes=config.max_body_size)
    app.state.router = state

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = getattr(exc, "code", None) or {404: "not_found", 405: "method_not_allowed"}.get(
            exc.status_code
        )
        headers = {**(exc.headers or {}), "x-request-id": request_id_of(request)}
        return error_response(exc.status_code, str(exc.detail), code, headers=headers)

    def unauthorized(request: Request, request_id: str) -> JSONResponse | None:
        if config.api_key is None:
            return None
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        # Constant time, on bytes (compare_digest refuses non-ASCII str: a 500 otherwise): the header
        # as sent (ASGI decodes it as latin-1), the key as UTF-8.
        if scheme.lower() == "bearer" and secrets.compare_digest(
            token.strip().encode("latin-1"), config.api_key.encode()
        ):
            return None
        return error_response(
            401,
            "Incorrect API key provided. Send 'Authorization: Bearer <key>'.",
            "invalid_api_key",
            headers={"x-request-id": request_id, "www-authenticate": "Bearer"},
        )

    async def proxied(request: Request, endpoint: str) -> Response:
        request_id = request_id_of(request)
        denied = unauthorized(request, request_id)
        if denied is not None:
            return denied
        return await state.proxy.forward(request, endpoint, request_id)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxied(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await proxied(request, "chat")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        request_id = request_id_of(request)
        denied = unauthorized(request, request_id)
        if denied is not None:
            return denied
        cards = state.pool.healthy_models()
        return JSONResponse(
            {"object": "list", "data": [cards[m] for m in sorted(cards)]},
            headers={"x-request-id": request_id},
        )

    @app.get("/health")
    async def health() -> JSONResponse:
        backends = [
            {
                "url": b.url,
                "healthy": b.healthy,
                "models": sorted(b.models),
                "in_flight": b.in_flight,
                "error": b.last_error,
            }
            for b in state.pool.backends
        ]
        ok = any(b.healthy for b in state.pool.backends)
        return JSONResponse(
            {"status": "ok" if ok else "unavailable", "backends": backends}, 200 if ok else 503
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=state.metrics.content_type)

    return app


def run_router(config: RouterConfig, log_level: str = "info") -> None:
    """Serve the router on `config.host:config.port` until interrupted."""
    import uvicorn

    uvicorn.run(
        create_app(config),
        host=config.host,
        port=config.port,
        log_level=log_level,
        access_log=False,  # the router logs each request with its x-request-id itself
        timeout_keep_alive=DEFAULT_KEEP_ALIVE_S,
    )
