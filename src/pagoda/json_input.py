"""JSON objects a user brings, in a file (config.json, generation_config.json, a shard index,
tokenizer.json) or as a field's text (a schema, tool call arguments): every failure is a
ValueError naming the file or the field."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def read_json_object(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON object `path` holds. ValueError naming the file if it cannot be read, is not UTF-8
    JSON, or holds something other than an object."""
    file = Path(path)
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read {str(file)!r}: {err}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{str(file)!r} does not hold a JSON object")
    return value


def parse_json_object(value: object, what: str) -> dict[str, Any]:
    """`value` as a dict: a dict as it is, a string parsed as JSON. ValueError naming `what` if the
    text is not JSON or the value is not an object."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ValueError(f"{what} is not valid JSON: {err}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be a JSON object, got {type(value).__name__}")
    return value
