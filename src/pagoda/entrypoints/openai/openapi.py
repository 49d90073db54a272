"""The server's OpenAPI document, made to describe the requests it really accepts.

FastAPI derives the document from the pydantic models; what only the running server knows is
added here: the served model names, the vocabulary and context sizes, the request limits, the
value ranges SamplingParams enforces, and the responses every endpoint can give (OpenAI errors
with 400 / 401 / 404 / 413 / 503, never FastAPI's 422; SSE for streamed completions). The schema
fuzz test (tests/entrypoints/test_fuzz.py) checks that data outside the document is rejected.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from pagoda.entrypoints.openai.protocol import ChatCompletionResponse, CompletionResponse
from pagoda.limits import RequestLimits
from pagoda.sampling_params import MAX_TEMPERATURE, REPETITION_PENALTY_RANGE

_ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
_ERROR = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
_ERROR_TEXT = {
    400: "invalid request: the error names the field (`param`)",
    401: "missing or wrong API key",
    404: "unknown model",
    413: "request body larger than --max-body-size",
    503: "the engine is not running, or the server is overloaded",
}


def install_openapi(
    app: FastAPI,
    *,
    model_names: list[str],
    limits: RequestLimits,
    vocab_size: int,
    max_model_len: int,
    chat_roles: tuple[str, ...] | None,
    auth: bool,
) -> None:
    """Make `app.openapi()` return the document with this server's constraints (built once)."""
    cache: dict[str, Any] = {}

    def openapi() -> dict[str, Any]:
        if "doc" not in cache:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            _constrain_requests(doc, model_names, limits, vocab_size, max_model_len, chat_roles)
            _describe_responses(doc, auth)
            cache["doc"] = doc
        return cache["doc"]

    app.openapi = openapi  # type: ignore[method-assign]


# ---- request bodies --------------------------------------------------------------------------------
def _constrain_requests(
    doc: dict[str, Any],
    model_names: list[str],
    limits: RequestLimits,
    vocab: int,
    max_model_len: int,
    chat_roles: tuple[str, ...] | None,
) -> None:
    schemas = doc["components"]["schemas"]
    schemas.pop("HTTPValidationError", None)
    schemas.pop("ValidationError", None)
    schemas["ErrorResponse"] = _ERROR_SCHEMA
    token_id = {"type": "integer", "minimum": 0, "maximum": vocab - 1}
    max_new = max_model_len - 1  # the prompt has at least one token
    text_limit = limits.prompt_char_limit(max_model_len)
    stop_string = {"type": "string", "minLength": 1, "maxLength": limits.max_stop_chars}
    grammar_text = {"type": "string", "maxLength": limits.max_grammar_chars}
    choices = {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}}
    sampling: dict[str, Callable[[dict[str, Any]], None]] = {
        "model": _set(enum=list(model_names)),
        "n": _set(minimum=1, maximum=limits.max_n),
        "temperature": _set(minimum=0, maximum=MAX_TEMPERATURE),
        "top_p": _set(exclusiveMinimum=0, maximum=1),
        "top_k": _set(minimum=-1),
        "min_p": _set(minimum=0, maximum=1),
        "repetition_penalty": _set(minimum=REPETITION_PENALTY_RANGE[0], maximum=REPETITION_PENALTY_RANGE[1]),
        "presence_penalty": _set(minimum=-2, maximum=2),
        "frequency_penalty": _set(minimum=-2, maximum=2),
        "min_tokens": _set(minimum=0, maximum=max_new),
        "stop": _replace(
            {
                "anyOf": [
                    stop_string,
                    {"type": "array", "maxItems": limits.max_stop, "items": stop_string},
                    {"type": "null"},
                ]
            }
        ),
        "stop_token_ids": _set(maxItems=limits.max_stop, items=token_id),
        "logit_bias": _set(
            maxProperties=limits.max_logit_bias,
            propertyNames={"pattern": "^[0-9]+$"},
            additionalProperties={"type": "number", "minimum": -100, "maximum": 100},
        ),
        "guided_json": _set_where("string", maxLength=limits.max_grammar_chars),
        "guided_regex": _set(**grammar_text),
        "guided_grammar": _set(**grammar_text),
        "guided_choice": _set(**choices),
        "prompt_logprobs": _set(minimum=0, maximum=limits.max_logprobs),
        "logprob_start_len": _set(minimum=0, maximum=max_model_len - 1),
    }
    prompt_text = {"type": "string", "minLength": 1, "maxLength": text_limit}
    prompt_ids = {"type": "array", "minItems": 1, "maxItems": max_new, "items": token_id}
    completion = {
        **sampling,
        "prompt": _replace(
            {
                "anyOf": [
                    prompt_text,
                    {"type": "array", "minItems": 1, "maxItems": limits.max_sequences, "items": prompt_text},
                    prompt_ids,
                    {"type": "array", "minItems": 1, "maxItems": limits.max_sequences, "items": prompt_ids},
                ]
            }
        ),
        "max_tokens": _set(
            minimum=0,
            maximum=max_new,
            description="0: the prompt alone (prompt-only: computed and scored, nothing generated)",
        ),
        "logprobs": _set(minimum=0, maximum=limits.max_logprobs),
        "suffix": _replace({"type": "null", "description": "not supported: must be null"}),
        "best_of": _set(minimum=1, maximum=limits.max_n, description="must equal n"),
        "logprob_start_char": _set(
            minimum=0,
            maximum=text_limit,
            description="pagoda: prompt logprobs of each text prompt's tokens after its first N characters "
            "(from its first token that differs from theirs), the span alone from prompt_logprobs_start",
        ),
    }
    chat = {
        **sampling,
        "messages": _set(minItems=1, maxItems=limits.max_messages),
        "max_tokens": _set(minimum=1, maximum=max_new),
        "max_completion_tokens": _set(minimum=1, maximum=max_new),
        "top_logprobs": _set(minimum=0, maximum=limits.max_logprobs),
    }
    tokenize = {
        "model": sampling["model"],
        "prompt": _set(maxLength=text_limit),
        "messages": _set(minItems=1, maxItems=limits.max_messages),
    }
    detokenize = {"model": sampling["model"], "tokens": _set(maxItems=max_model_len, items=token_id)}
    structured = {
        "json": _set_where("string", maxLength=limits.max_grammar_chars),
        "regex": _set(**grammar_text),
        "grammar": _set(**grammar_text),
        "choice": _set(**choices),
        "structural_tag": _set_where("string", maxLength=limits.max_grammar_chars),
    }
    prediction = {"content": _set_where("string", maxLength=limits.max_prediction_chars)}
    message: dict[str, Callable[[dict[str, Any]], None]] = {}
    if chat_roles is not None:
        message["role"] = _set(enum=list(chat_roles))
    part = {"type": _set(enum=["text"])}
    for name, rules in (
        ("CompletionRequest", completion),
        ("ChatCompletionRequest", chat),
        ("TokenizeRequest", tokenize),
        ("DetokenizeRequest", detokenize),
        ("StructuredOutputsField", structured),
        ("ChatMessage", message),
        ("ContentPart", part),
        ("Prediction", prediction),
    ):
        schema = schemas.get(name)
        if schema is None:
            continue
        properties = schema.get("properties", {})
        for field, rule in rules.items():
            if field in properties:
                rule(properties[field])
    if "ContentPart" in schemas:  # only text parts, each with its text
        schemas["ContentPart"]["required"] = ["type", "text"]
        schemas["ContentPart"]["properties"]["text"] = {"type": "string"}


def _branches(prop: dict[str, Any]) -> list[dict[str, Any]]:
    """The non-null alternatives of a property (pydantic writes Optional[X] as anyOf [X, null])."""
    options = prop.get("anyOf")
    if options is None:
        return [prop]
    return [o for o in options if o.get("type") != "null"]


def _set(**constraints: Any) -> Callable[[dict[str, Any]], None]:
    def apply(prop: dict[str, Any]) -> None:
        for branch in _branches(prop):
            branch.update(constraints)

    return apply


def _set_where(type_: str, **constraints: Any) -> Callable[[dict[str, Any]], None]:
    def apply(prop: dict[str, Any]) -> None:
        for branch in _branches(prop):
            if branch.get("type") == type_:
                branch.update(constraints)

    return apply


def _replace(schema: dict[str, Any]) -> Callable[[dict[str, Any]], None]:
    def apply(prop: dict[str, Any]) -> None:
        keep = {k: v for k, v in prop.items() if k in ("title", "default")}
        prop.clear()
        prop.update(schema, **keep)

    return apply


# ---- responses -------------------------------------------------------------------------------------
def _describe_responses(doc: dict[str, Any], auth: bool) -> None:
    for path, methods in doc["paths"].items():
        for method, op in methods.items():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            codes = []
            if method == "post":
                codes += [400, 413]
            if auth and path != "/health":
                codes.append(401)
            if path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize") or (
                path.startswith("/v1/models/")
            ):
                codes.append(404)
            if path in ("/v1/completions", "/v1/chat/completions", "/reset_prefix_cache", "/health"):
                codes.append(503)
            for code in codes:
                responses[str(code)] = {"description": _ERROR_TEXT[code], "content": _ERROR}
    ok = {
        "/health": {"description": "the engine is running (empty body)", "content": {}},
        "/metrics": {
            "description": "Prometheus metrics",
            "content": {"text/plain": {"schema": {"type": "string"}}},
        },
        "/v1/completions": _generation("CompletionResponse"),
        "/v1/chat/completions": _generation("ChatCompletionResponse"),
    }
    for path, response in ok.items():
        for op in doc["paths"].get(path, {}).values():
            op["responses"]["200"] = response
    schemas = doc["components"]["schemas"]
    for model in (CompletionResponse, ChatCompletionResponse):
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}", mode="serialization")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema


def _generation(model: str) -> dict[str, Any]:
    return {
        "description": "the completion, or with stream: true its chunks as server-sent events",
        "content": {
            "application/json": {"schema": {"$ref": f"#/components/schemas/{model}"}},
            # Each event's data is one JSON chunk, an OpenAI error, or [DONE].
            "text/event-stream": {
                "schema": {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}
            },
        },
    }
