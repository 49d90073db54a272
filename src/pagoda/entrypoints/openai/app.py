"""The OpenAI-compatible FastAPI app and the uvicorn server around it."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import secrets
import signal
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pagoda import __version__
from pagoda.config import EngineArgs
from pagoda.engine.async_engine import AsyncLLM
from pagoda.engine.llm_engine import LLMEngine
from pagoda.entrypoints.openai.chat_render import render_chat
from pagoda.entrypoints.openai.chat_settings import ChatSettings, log_settings
from pagoda.entrypoints.openai.errors import APIError, install_error_handlers
from pagoda.entrypoints.openai.limits import StrictJSONRoute
from pagoda.entrypoints.openai.metrics import ServerMetrics
from pagoda.entrypoints.openai.openapi import install_openapi
from pagoda.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    ParamError,
    TokenizeRequest,
)
from pagoda.entrypoints.openai.serving_chat import create_chat_completion
from pagoda.entrypoints.openai.serving_common import ServerState
from pagoda.entrypoints.openai.serving_completions import create_completion
from pagoda.entrypoints.server_args import ServerArgs
from pagoda.http_body import BodySizeLimit
from pagoda.limits import LimitError
from pagoda.tokenizer.chat import chat_roles

logger = logging.getLogger("pagoda.server")


def build_state(engine: LLMEngine, config: ServerArgs) -> ServerState:
    """Start the engine thread with Prometheus metrics attached."""
    name = config.served_model_name or engine.args.model
    chat = ChatSettings.create(
        engine.tokenizer,
        tool_call_parser=config.tool_call_parser,
        reasoning_parser=config.reasoning_parser,
        default_kwargs=config.default_chat_template_kwargs,
    )
    metrics = ServerMetrics(name)
    async_engine = AsyncLLM(engine, max_waiting_requests=config.max_waiting_requests, on_step=metrics.on_step)
    return ServerState(
        async_engine,
        metrics,
        [name],
        engine.args.model,
        config.resolved_api_key(),
        chat,
        limits=engine.args.limits,
        max_body_size=config.max_body_size,
    )


def create_app(state: ServerState) -> FastAPI:
    """The app for a running AsyncLLM; stopping the app shuts the engine down."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        state.shutdown()

    app = FastAPI(title="pagoda", lifespan=lifespan)
    app.state.pagoda = state
    if state.max_body_size is not None:
        app.add_middleware(BodySizeLimit, max_bytes=state.max_body_size)
    install_error_handlers(app)

    def check_auth(request: Request) -> None:
        if state.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        # Constant time, on bytes: the header as sent (ASGI decodes it as latin-1), the key as UTF-8.
        if scheme.lower() != "bearer" or not secrets.compare_digest(
            token.strip().encode("latin-1"), state.api_key.encode()
        ):
            raise APIError(
                "invalid or missing API key: send 'Authorization: Bearer <key>'", 401, code="invalid_api_key"
            )

    @app.get("/health")
    async def health() -> Response:
        if not state.engine.is_running:
            raise APIError("the engine is not running", 503, code="engine_unavailable")
        return Response(status_code=200)

    api = APIRouter(dependencies=[Depends(check_auth)], route_class=StrictJSONRoute)

    def card(name: str) -> ModelCard:
        return ModelCard(
            id=name,
            root=state.model_path,
            max_model_len=state.engine.max_model_len,
            format=state.engine.weight_format,
        )

    @api.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[card(n) for n in state.model_names])

    @api.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> ModelCard:
        return card(state.resolve_model(model_id))

    @api.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @api.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await create_completion(state, body, request)

    @api.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await create_chat_completion(state, body, request)

    @api.post("/tokenize", response_model=dict)
    async def tokenize(body: TokenizeRequest) -> Response:
        state.resolve_model(body.model)
        max_model_len = state.engine.max_model_len
        tokenizer = state.engine.tokenizer
        try:
            if body.messages is not None:
                body.template_checks(body.messages)
                state.limits.check_messages(body.messages, max_model_len)
            else:
                state.limits.check_prompt(body.prompt, max_model_len)
        except (ParamError, LimitError) as exc:
            raise APIError(str(exc), param=exc.param) from None
        if body.messages is not None:
            messages = body.messages
            ids = await state.off_loop(lambda: render_chat(tokenizer, state.chat, messages, body).prompt_ids)
        else:
            prompt = body.prompt
            ids = await state.off_loop(
                lambda: tokenizer(prompt, add_special_tokens=body.add_special_tokens)["input_ids"]
            )
        # A JSONResponse skips FastAPI's generic encoder (2 ms for 1,500 ids on the event loop).
        return JSONResponse({"count": len(ids), "max_model_len": max_model_len, "tokens": ids})

    @api.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        state.resolve_model(body.model)
        if len(body.tokens) > state.engine.max_model_len:
            message = (
                f"tokens: {len(body.tokens)} is more than the context length ({state.engine.max_model_len})"
            )
            raise APIError(message, param="tokens")
        bad = next((t for t in body.tokens if not 0 <= t < state.engine.vocab_size), None)
        if bad is not None:
            raise APIError(f"token id {bad} is not in [0, {state.engine.vocab_size})", param="tokens")
        return {"prompt": await state.off_loop(lambda: state.decode(body.tokens))}

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
    tokenizer = state.engine.tokenizer
    try:
        roles: tuple[str, ...] | None = chat_roles(tokenizer)
    except ValueError:  # no chat template: chat requests are refused whatever their roles
        roles = None
    install_openapi(
        app,
        model_names=state.model_names,
        limits=state.limits,
        vocab_size=state.engine.vocab_size,
        max_model_len=state.engine.max_model_len,
        chat_roles=roles,
        auth=state.api_key is not None,
    )
    return app


def freeze_startup_heap() -> None:
    """Move everything alive now (modules, model, tokenizer: hundreds of thousands of objects) out
    of the garbage collector's generations, as vLLM and SGLang do after start-up: a full collection
    walks every tracked object, and one over the start-up heap stopped the event loop (and every
    stream) for about 300 ms during a burst of requests. Garbage made later is collected as usual."""
    gc.collect()
    gc.freeze()
    logger.info("froze %d start-up objects out of the garbage collector", gc.get_freeze_count())


def run_server(engine_args: EngineArgs, config: ServerArgs) -> int:
    """Load the model, serve until SIGINT/SIGTERM, then finish or abort in-flight requests. Returns 0,
    or 1 if the engine died of an error (which also stops the server)."""
    import uvicorn

    engine = LLMEngine(engine_args)
    state = build_state(engine, config)
    log_settings(state.chat)
    app = create_app(state)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level=config.log_level,
            timeout_graceful_shutdown=config.shutdown_timeout,
            timeout_keep_alive=config.timeout_keep_alive,
            access_log=False,
        )
    )
    # uvicorn re-raises the signal that stopped it once it is done; the no-op handlers turn that into
    # a normal return, so a requested shutdown exits with status 0.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}

    def engine_died(exc: BaseException) -> None:
        # In-flight requests have had their error events; stop serving so that the process exits
        # non-zero and a supervisor can restart it (/health answers 503 until then).
        logger.error("the engine stopped after an error (%r); shutting the server down", exc)
        server.should_exit = True

    state.engine.on_error = engine_died
    rank_failures: list[str] = []

    def rank_died(why: str) -> None:
        # A tensor-parallel rank of this node exited: a step in flight fails by itself (its
        # collective breaks); an idle server must stop too.
        rank_failures.append(why)
        logger.error("%s; shutting the server down", why)
        server.should_exit = True

    engine.core.executor.watch(rank_died)
    if state.engine.error is not None:  # it died before the callback was set
        server.should_exit = True
    freeze_startup_heap()
    try:
        logger.info("serving %s on http://%s:%d", state.model_names[0], config.host, config.port)
        server.run()
    finally:
        state.shutdown()
        engine.shutdown()  # the tensor-parallel ranks, if any
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    code = 0 if state.engine.error is None and not rank_failures else 1
    if not engine.wait_for_grammar_compiles(config.shutdown_timeout):
        # A grammar compile past its deadline still runs and cannot be interrupted; exiting the
        # interpreter under it would abort the process, so leave without finalizing.
        logger.warning("exiting with a grammar compile still running")
        logging.shutdown()
        os._exit(code)
    return code
