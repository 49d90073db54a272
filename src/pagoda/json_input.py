"""Reading a JSON object from a file a user brings (config.json, generation_config.json, a shard
index, tokenizer.json): every failure is a ValueError naming the file."""

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
