"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` for every failure."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    def __init__(self, message: str, status: int = 400, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": _TYPES.get(self.status, "server_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """The first pydantic error as a 400 naming its field."""
    err = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    loc = [str(part) for part in err.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    if err.get("type") == "extra_forbidden":
        return APIError(f"unknown field {param!r}: this server does not support it", param=param)
    if err.get("type") == "json_invalid":
        return APIError(f"the request body is not valid JSON: {err.get('msg')}")
    if param is None and err.get("type") == "missing":
        return APIError("the request needs a JSON object body (Content-Type: application/json)")
    message = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    return APIError(f"{param}: {message}" if param else message, param=param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(list(exc.errors())).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        param, code = getattr(exc, "param", None), getattr(exc, "code", None)
        error = APIError(str(exc.detail), exc.status_code, param=param, code=code)
        return error.response(exc.headers)  # e.g. Allow on a 405

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error serving %s", request.url.path)
        return APIError(f"internal server error: {exc!r}", 500).response()
