"""Decoding an untrusted JSON request body so that every problem is an error naming its field.

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
        value = json.loads(text, parse_constant=_NonFinite)
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
    finite in a parsed JSON value (iteratively: depth costs no Python stack)."""
    stack: list[tuple[Any, tuple[str, ...]]] = [(value, ())]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            _check_text(item, path, invalid_utf8)
        elif isinstance(item, dict):
            for key, child in item.items():
                _check_text(key, (*path, key), invalid_utf8, is_key=True)
                stack.append((child, (*path, key)))
        elif isinstance(item, list):
            stack.extend((child, (*path, str(i))) for i, child in enumerate(item))
        elif isinstance(item, _NonFinite) or (isinstance(item, float) and not math.isfinite(item)):
            text = item.text if isinstance(item, _NonFinite) else repr(item)
            where = _param(path)
            raise BodyError(f"{where or 'the body'}: {text} is not a finite number", where)


def _param(path: tuple[str, ...]) -> str | None:
    return ".".join(path) or None


def _check_text(text: str, path: tuple[str, ...], invalid_utf8: bool, *, is_key: bool = False) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        where = _param(path[:-1] if is_key else path)
        what = f"a key of {where}" if is_key and where else "a key" if is_key else where or "the body"
        code = ord(text[exc.start])
        if invalid_utf8 and 0xDC80 <= code <= 0xDCFF:
            problem = f"byte 0x{code - 0xDC00:02X} is not valid UTF-8"
        else:
            problem = f"U+{code:04X} is a lone UTF-16 surrogate, not a Unicode character"
        raise BodyError(f"{what} is not valid Unicode text: {problem}", where) from None
