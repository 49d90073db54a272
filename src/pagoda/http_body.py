"""Reading untrusted HTTP request bodies: a size limit, and JSON decoded so that every problem is
an error naming its field.

Python's json module accepts things that are not JSON text or not text at all: NaN and Infinity
(and numbers like 1e400 that overflow to infinity), lone UTF-16 surrogates ("\\ud800"), and with
a lenient decode, bytes that are not UTF-8. The OpenAI server and the router both parse request
bodies here, so each of these is a 400 that names the field, before any other work. The cost is
one pass over the parsed value, proportional to the body's size.
"""

from __future__ import annotations

import json
import math
from typing import Any

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodyError(ValueError):
    """A request body that is not valid JSON text; `param` names the field when there is one."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class _NonFinite:
    """What `NaN`, `Infinity` and `-Infinity` parse to, so that the walk can name their field."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text


def _number(text: str) -> float | int:
    """A JSON number with a fraction or exponent; integral values become ints, as JSON Schema's
    "integer" includes 2.0 (the request models take ints for their float fields too)."""
    value = float(text)
    return int(value) if value.is_integer() else value


def parse_json_body(body: bytes) -> Any:
    """The parsed body; raises BodyError (message, param) for anything that is not JSON text."""
    try:
        text = body.decode("utf-8")
        invalid_utf8 = False
    except UnicodeDecodeError:
        # Invalid bytes become U+DC80..U+DCFF, which the walk below reports with their field.
        text = body.decode("utf-8", errors="surrogateescape")
        invalid_utf8 = True
    try:
        value = json.loads(text, parse_constant=_NonFinite, parse_float=_number)
    except json.JSONDecodeError as exc:
        raise BodyError(
            f"the request body is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})"
        ) from None
    except RecursionError:
        raise BodyError("the request body is not valid JSON: it is nested too deeply") from None
    except ValueError as exc:  # e.g. an integer with more digits than Python converts
        raise BodyError(f"the request body is not valid JSON: {exc}") from None
    check_json_value(value, invalid_utf8=invalid_utf8)
    return value


def check_json_value(value: Any, *, invalid_utf8: bool = False) -> None:
    """Raise BodyError naming the first string that is not valid Unicode or number that is not
    finite in a parsed JSON value (iteratively: depth costs no Python stack). Scalars that cannot
    be wrong (ints, bools, null, ASCII strings) are skipped without building their path."""
    stack: list[tuple[Any, _Where]] = [(value, None)]
    while stack:
        item, where = stack.pop()
        kind = type(item)
        if kind is str:
            _check_text(item, where, invalid_utf8)
        elif kind is dict:
            for key, child in item.items():
                if not key.isascii():
                    _check_text(key, where, invalid_utf8, key=key)
                if not _fine(child):
                    stack.append((child, (where, key)))
        elif kind is list:
            stack.extend((child, (where, str(i))) for i, child in enumerate(item) if not _fine(child))
        elif kind is _NonFinite or (kind is float and not math.isfinite(item)):
            text = item.text if kind is _NonFinite else repr(item)
            param = _param(where)
            raise BodyError(f"{param or 'the body'}: {text} is not a finite number", param)


# Where a value sits: None for the whole body, else (where its container sits, its key or index).
_Where = tuple[Any, str] | None


def _fine(value: Any) -> bool:
    kind = type(value)
    return kind is int or kind is bool or value is None or (kind is str and value.isascii())


def _param(where: _Where) -> str | None:
    parts: list[str] = []
    while where is not None:
        where, key = where
        parts.append(key)
    return ".".join(reversed(parts)) or None


def _check_text(text: str, where: _Where, invalid_utf8: bool, *, key: str | None = None) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        param = _param(where)
        what = (f"a key of {param}" if param else "a key") if key is not None else param or "the body"
        code = ord(text[exc.start])
        if invalid_utf8 and 0xDC80 <= code <= 0xDCFF:
            problem = f"byte 0x{code - 0xDC00:02X} is not valid UTF-8"
        else:
            problem = f"U+{code:04X} is a lone UTF-16 surrogate, not a Unicode character"
        raise BodyError(f"{what} is not valid Unicode text: {problem}", param) from None


# ---- size ------------------------------------------------------------------------------------------
class BodyTooLarge(HTTPException):
    """Raised while the app reads a body past the limit. An HTTPException, so that FastAPI re-raises
    it from its body parsing and the app's own handler answers with an OpenAI-shaped 413."""

    code = "request_too_large"

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, f"the request body is larger than {max_bytes} bytes (--max-body-size)")


class BodySizeLimit:
    """ASGI middleware: a request body over `max_bytes` gets a 413 at once when its Content-Length
    says so (the app never runs), else as soon as the bytes read pass the limit (`BodyTooLarge`)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await _send_413(send, BodyTooLarge(self.max_bytes))
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, limited_receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _send_413(send: Send, error: BodyTooLarge) -> None:
    body = json.dumps(
        {
            "error": {
                "message": error.detail,
                "type": "invalid_request_error",
                "param": None,
                "code": error.code,
            }
        }
    ).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 413, "headers": headers})
    await send({"type": "http.response.body", "body": body})
