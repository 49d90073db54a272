"""Flags generated from dataclass fields (pagoda.cli_args): names, types, defaults, help, round trips."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

import pytest

from pagoda.cli_args import add_arguments, arg, to_argv, values_from


@dataclass(frozen=True)
class Toy:
    name: str = arg(help="a name")  # no default: a required flag
    count: int = arg(3, help="how many")
    ratio: float | None = arg(None, help="a ratio", default_text="from the data")
    mode: Literal["fast", "slow"] = arg("fast", help="speed")
    verbose: bool = arg(False, help="talk more")
    tags: list[str] = arg(default_factory=list, help="a tag (repeatable)")
    sizes: list[int] = arg(default_factory=list, nargs="+", help="sizes")
    share: float = arg(0.5, help="fraction (50%)")
    options: dict[str, Any] | None = arg(None, help="a JSON object")
    unflagged: int = 7  # not declared with arg(): no flag


def parser(**kwargs) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="toy", exit_on_error=False)
    add_arguments(p, Toy, **kwargs)
    return p


def test_names_types_and_defaults() -> None:
    ns = parser().parse_args(["--name", "x"])
    assert values_from(Toy, ns) == {
        "name": "x",
        "count": 3,
        "ratio": None,
        "mode": "fast",
        "verbose": False,
        "tags": [],
        "sizes": [],
        "share": 0.5,
        "options": None,
    }
    argv = ["--name", "y", "--count", "5", "--ratio", "0.25", "--mode", "slow", "--verbose"]
    argv += ["--tags", "a", "--tags", "b", "--sizes", "1", "2", "--share", "1", "--options", '{"k": [1]}']
    toy = Toy(**values_from(Toy, parser().parse_args(argv)))
    assert toy == Toy("y", 5, 0.25, "slow", True, ["a", "b"], [1, 2], 1.0, {"k": [1]})
    assert not hasattr(parser().parse_args(["--name", "z"]), "unflagged")


def test_parsing_twice_does_not_share_a_default_list() -> None:
    p = parser()
    assert p.parse_args(["--name", "x", "--tags", "a"]).tags == ["a"]
    assert p.parse_args(["--name", "x"]).tags == []


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--count", "3"], "--name"),  # required
        (["--name", "x", "--count", "three"], "--count"),
        (["--name", "x", "--mode", "medium"], "--mode"),
        (["--name", "x", "--sizes", "1", "x"], "--sizes"),
        (["--name", "x", "--ratio", "half"], "--ratio"),
        (["--name", "x", "--options", "[1]"], "--options"),
        (["--name", "x", "--options", "{bad"], "--options"),
    ],
)
def test_bad_values_are_argparse_errors_naming_the_flag(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    p = parser()
    p.exit_on_error = True
    with pytest.raises(SystemExit) as info:
        p.parse_args(argv)
    assert info.value.code == 2 and flag in capsys.readouterr().err


def test_help_text_and_shown_defaults() -> None:
    helps = {a.dest: a.help for a in parser()._actions}
    assert helps["name"] == "a name"
    assert helps["count"] == "how many (default: 3)"
    assert helps["ratio"] == "a ratio (default: from the data)"
    assert helps["verbose"] == "talk more (default: off)"
    assert helps["tags"] == "a tag (repeatable)"
    assert helps["share"] == "fraction (50%%) (default: 0.5)"  # argparse expands % formats
    assert "fraction (50%) (default: 0.5)" in parser().format_help()


def test_include_exclude_and_per_command_overrides() -> None:
    p = parser(include=("name", "count", "mode"), exclude=("mode",), defaults={"count": 9}, choices={})
    ns = p.parse_args(["--name", "x"])
    assert vars(ns) == {"name": "x", "count": 9}
    assert {a.dest: a.help for a in p._actions}["count"] == "how many (default: 9)"
    helps = {a.dest: a.help for a in parser(defaults={"ratio": 0.3})._actions}
    assert helps["ratio"] == "a ratio (default: 0.3)"  # the command's default, not the field's words
    p = parser(choices={"mode": ("slow",)})
    assert p.parse_args(["--name", "x", "--mode", "slow"]).mode == "slow"
    with pytest.raises(argparse.ArgumentError, match="--mode"):
        p.parse_args(["--name", "x", "--mode", "fast"])
    with pytest.raises(TypeError, match="no flag fields"):
        parser(defaults={"countt": 1})
    with pytest.raises(TypeError, match="no flag fields"):
        parser(include=("unflagged",))


def test_to_argv_parses_back_to_the_same_values() -> None:
    toy = Toy("n", 4, 0.75, "slow", True, ["a", "b c"], [5, 6], 0.1, {"x": {"y": "z w"}})
    values = dataclasses.asdict(toy)
    assert Toy(**values_from(Toy, parser().parse_args(to_argv(Toy, values)))) == toy
    off = Toy("n", verbose=False)
    argv = to_argv(Toy, dataclasses.asdict(off))
    assert "--no-verbose" in argv and "--ratio" not in argv and "--sizes" not in argv
    assert Toy(**values_from(Toy, parser().parse_args(argv))) == off


def test_a_flag_needs_help_text() -> None:
    with pytest.raises(TypeError):

        @dataclass
        class Bad:
            x: int = arg(1)  # type: ignore[call-arg]
