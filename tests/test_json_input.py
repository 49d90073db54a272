"""read_json_object / parse_json_object: the one strict read of the JSON files and texts a user
brings, and some of their callers."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagoda.json_input import parse_json_object, read_json_object
from pagoda.models.hf_config import read_hf_config
from pagoda.models.loader import checkpoint_files


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b"{broken", "cannot read"),
        (b'{"a": "\xff"}', "cannot read"),  # not UTF-8
        (b"[1, 2]", "does not hold a JSON object"),
        (b'"text"', "does not hold a JSON object"),
    ],
)
def test_bad_files_are_value_errors_naming_the_file(tmp_path: Path, content: bytes, match: str) -> None:
    path = tmp_path / "x.json"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=match) as err:
        read_json_object(path)
    assert str(path) in str(err.value)


def test_reads_an_object(tmp_path: Path) -> None:
    path = tmp_path / "x.json"
    path.write_text('{"a": [1, 2], "b": {"c": null}}', encoding="utf-8")
    assert read_json_object(path) == {"a": [1, 2], "b": {"c": None}}
    with pytest.raises(ValueError, match="cannot read"):
        read_json_object(tmp_path / "missing.json")


def test_callers(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("[]")
    with pytest.raises(ValueError, match=r"config\.json' does not hold a JSON object"):
        read_hf_config(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": [1]}')
    with pytest.raises(ValueError, match="has no 'weight_map'"):
        checkpoint_files(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("{")
    with pytest.raises(ValueError, match="cannot read"):
        checkpoint_files(tmp_path)


def test_parse_json_object() -> None:
    assert parse_json_object('{"a": 1}', "x") == {"a": 1}
    value = {"b": [2]}
    assert parse_json_object(value, "x") is value
    with pytest.raises(ValueError, match=r"^tools\[0\]\.arguments is not valid JSON: "):
        parse_json_object("{nope", "tools[0].arguments")
    for bad, kind in (("[1]", "list"), ('"s"', "str"), (3, "int"), (None, "NoneType")):
        with pytest.raises(ValueError, match=f"^schema must be a JSON object, got {kind}$"):
            parse_json_object(bad, "schema")
