"""The server's side of the request limits: bodies parsed strictly before FastAPI validates them.

Every POST endpoint's JSON body goes through `pagoda.http_body` (invalid UTF-8, lone surrogates,
NaN / Infinity are a 400 naming the field; a body over --max-body-size is a 413). The limits on what a request asks for (n, stop strings, grammar size, ...) live in
`pagoda.limits.RequestLimits`, which the engine checks too; the handlers call them before any
tokenizing, compiling or engine work.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

from pagoda.http_body import BodyError, parse_json_body
from pagoda.limits import LimitError, RequestLimits


class InvalidBody(HTTPException):
    """Raised while FastAPI reads the body (it re-raises HTTPExceptions from there); the app's
    handler turns it into an OpenAI error with `param`."""

    def __init__(self, error: BodyError) -> None:
        super().__init__(400, str(error))
        self.param = error.param


class _StrictJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_strict_json"):
            try:
                self._strict_json = parse_json_body(await self.body())
            except BodyError as exc:
                raise InvalidBody(exc) from None
        return self._strict_json


class StrictJSONRoute(APIRoute):
    """An APIRoute whose JSON body is parsed by `parse_json_body` instead of `json.loads`."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict(request: Request) -> Response:
            return await handler(_StrictJSONRequest(request.scope, request.receive))

        return strict


_CONSTRAINT_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar")


def constraint_field(body: Any) -> str | None:
    """The request field an output constraint came from (the protocol allows only one), for errors."""
    for name in _CONSTRAINT_FIELDS:
        if getattr(body, name, None) is not None:
            return name
    spec = getattr(body, "structured_outputs", None)
    if spec is not None:
        given = [k for k, v in spec.model_dump(exclude_none=True, by_alias=True).items() if v is not None]
        return f"structured_outputs.{given[0]}" if given else "structured_outputs"
    return None


def check_body(limits: RequestLimits, body: Any, num_prompts: int) -> None:
    """What a completion or chat body asks for before SamplingParams are built: prompts x n, and
    logit_bias keys written as token ids (ASCII digits, as the OpenAPI document says)."""
    limits.check_sequences(num_prompts, body.n)
    for key in body.logit_bias or ():
        if not (key.isascii() and key.isdigit()):
            raise LimitError(f"logit_bias key {key!r:.40} is not a token id (digits 0-9)", "logit_bias")
