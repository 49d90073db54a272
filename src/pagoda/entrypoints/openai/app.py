"""The OpenAI-compatible FastAPI app and the uvicorn server around it."""

from __future__ import annotations

import contextlib
import logging
import secrets
import signal
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import Response

from pagoda.config import EngineArgs
from pagoda.engine.async_engine import AsyncLLM
from pagoda.engine.llm_engine import LLMEngine
from pagoda.entrypoints.openai.errors import APIError, install_error_handlers
from pagoda.entrypoints.openai.metrics import ServerMetrics
from pagoda.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from pagoda.entrypoints.openai.serving_chat import create_chat_completion
from pagoda.entrypoints.openai.serving_common import ServerState
from pagoda.entrypoints.openai.serving_completions import create_completion
from pagoda.entrypoints.server_args import ServerArgs
from pagoda.tokenizer import apply_chat_template

logger = logging.getLogger("pagoda.server")


def build_state(engine: LLMEngine, config: ServerArgs) -> ServerState:
    """Start the engine thread with Prometheus metrics attached."""
    name = config.served_model_name or engine.args.model
    metrics = ServerMetrics(name)
    async_engine = AsyncLLM(engine, max_waiting_requests=config.max_waiting_requests, on_step=metrics.on_step)
    return ServerState(async_engine, metrics, [name], engine.args.model, config.resolved_api_key())


def create_app(state: ServerState) -> FastAPI:
    """The app for a running AsyncLLM; stopping the app shuts the engine down."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        state.engine.shutdown()

    app = FastAPI(title="pagoda", lifespan=lifespan)
    app.state.pagoda = state
    install_error_handlers(app)

    def check_auth(request: Request) -> None:
        if state.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(
            token.strip().encode(), state.api_key.encode()
        ):
            raise APIError(
                "invalid or missing API key: send 'Authorization: Bearer <key>'", 401, code="invalid_api_key"
            )

    @app.get("/health")
    async def health() -> Response:
        if not state.engine.is_running:
            raise APIError("the engine is not running", 503, code="engine_unavailable")
        return Response(status_code=200)

    api = APIRouter(dependencies=[Depends(check_auth)])

    @api.get("/v1/models")
    async def models() -> ModelList:
        cards = [
            ModelCard(id=n, root=state.model_path, max_model_len=state.engine.max_model_len)
            for n in state.model_names
        ]
        return ModelList(data=cards)

    @api.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await create_completion(state, body, request)

    @api.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await create_chat_completion(state, body, request)

    @api.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        state.resolve_model(body.model)
        if body.messages is not None:
            messages = [m.to_dict() for m in body.messages]
            try:
                ids = apply_chat_template(
                    state.engine.tokenizer, messages, add_generation_prompt=body.add_generation_prompt
                )
            except ValueError as exc:
                raise APIError(str(exc), param="messages") from None
        else:
            ids = state.engine.tokenizer(body.prompt, add_special_tokens=body.add_special_tokens)["input_ids"]
        return {"count": len(ids), "max_model_len": state.engine.max_model_len, "tokens": ids}

    @api.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        state.resolve_model(body.model)
        bad = next((t for t in body.tokens if not 0 <= t < state.engine.vocab_size), None)
        if bad is not None:
            raise APIError(f"token id {bad} is not in [0, {state.engine.vocab_size})", param="tokens")
        return {"prompt": state.decode(body.tokens)}

    @api.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict:
        """Drop every cached prefix not in use (as vLLM's endpoint of the same name)."""
        freed = await state.engine.call(lambda engine: engine.reset_prefix_cache())
        return {"freed_blocks": freed}

    @api.get("/metrics")
    async def metrics() -> Response:
        data, content_type = state.metrics.render()
        return Response(data, media_type=content_type)

    app.include_router(api)
    return app


def run_server(engine_args: EngineArgs, config: ServerArgs) -> int:
    """Load the model, serve until SIGINT/SIGTERM, then finish or abort in-flight requests. Returns 0."""
    import uvicorn

    engine = LLMEngine(engine_args)
    state = build_state(engine, config)
    app = create_app(state)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level=config.log_level,
            timeout_graceful_shutdown=config.shutdown_timeout,
            access_log=False,
        )
    )
    # uvicorn re-raises the signal that stopped it once it is done; the no-op handlers turn that into
    # a normal return, so a requested shutdown exits with status 0.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        logger.info("serving %s on http://%s:%d", state.model_names[0], config.host, config.port)
        server.run()
    finally:
        state.engine.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0 if state.engine.error is None else 1
