"""OpenAI-shaped error bodies: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse


def error_body(message: str, type_: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(
    status: int,
    message: str,
    code: str | None = None,
    headers: dict[str, str] | None = None,
    param: str | None = None,
) -> JSONResponse:
    type_ = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse(error_body(message, type_, code, param), status_code=status, headers=headers)


def sse_error_event(message: str, code: str) -> bytes:
    """An SSE event carrying an error, sent when a stream breaks after bytes reached the client."""
    return b"data: " + json.dumps(error_body(message, "server_error", code)).encode() + b"\n\n"


def is_openai_error(body: bytes) -> bool:
    """Whether a backend's error body already has the OpenAI shape (so it can pass through as is)."""
    try:
        data = json.loads(body)
    except ValueError:
        return False
    return isinstance(data, dict) and isinstance(data.get("error"), dict) and "message" in data["error"]
