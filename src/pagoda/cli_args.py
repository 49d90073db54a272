"""Command-line flags generated from dataclass fields, so that a setting is declared once.

A field declared with `arg(default, help=...)` becomes the flag `--field-name` (underscores become
dashes). Its type comes from the annotation: `int`, `float` and `str` parse as such, `bool` gives
`--x / --no-x`, `Literal[...]` gives choices, `X | None` parses as X, `list[X]` repeats (action
"append", or `nargs`), `dict[...]` takes a JSON object. The help text comes from the metadata and the default from the field, shown
as "(default: ...)" (`default_text` says it in words where the default is None or computed). A
field without a default is a required flag. Validation of the values stays in the dataclass's
`__post_init__`; argparse only rejects what does not parse (naming the flag).

This module is stdlib-only: the CLI builds its parsers from it without importing the engine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from pagoda.json_input import parse_json_object

_KEY = "pagoda.cli"


@dataclasses.dataclass(frozen=True)
class FlagSpec:
    help: str
    default_text: str | None = None  # the default in words; None: the field's default value
    choices: tuple[Any, ...] | None = None  # None: from a Literal annotation, if any
    type: Callable[[str], Any] | None = None  # None: from the annotation
    metavar: str | None = None
    nargs: str | int | None = None  # for list fields: "+" or a count instead of a repeated flag


def arg(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    default_factory: Callable[[], Any] | Any = dataclasses.MISSING,
    default_text: str | None = None,
    choices: Sequence[Any] | None = None,
    type: Callable[[str], Any] | None = None,
    metavar: str | None = None,
    nargs: str | int | None = None,
) -> Any:
    """A dataclass field that is also a command-line flag (see the module docstring)."""
    spec = FlagSpec(help, default_text, tuple(choices) if choices is not None else None, type, metavar, nargs)
    return dataclasses.field(default=default, default_factory=default_factory, metadata={_KEY: spec})


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def flag_fields(cls: type) -> Iterator[tuple[dataclasses.Field, FlagSpec, Any]]:
    """(field, spec, resolved annotation) for every field of `cls` declared with `arg`."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        spec = f.metadata.get(_KEY)
        if spec is not None:
            yield f, spec, hints[f.name]


def field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def add_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    *,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] = (),
    defaults: Mapping[str, Any] | None = None,
    choices: Mapping[str, Sequence[Any]] | None = None,
) -> None:
    """Add a flag for each `arg` field of `cls` (those in `include`, if given, less `exclude`) to
    `parser` or an argument group. `defaults` and `choices` override a field's for this command."""
    defaults = dict(defaults or {})
    choices = dict(choices or {})
    known = {f.name for f, _, _ in flag_fields(cls)}
    unknown = (set(include or ()) | set(exclude) | set(defaults) | set(choices)) - known
    if unknown:
        raise TypeError(f"{cls.__name__} has no flag fields {sorted(unknown)}")
    for f, spec, hint in flag_fields(cls):
        if (include is not None and f.name not in include) or f.name in exclude:
            continue
        default = field_default(f)
        if f.name in defaults:  # this command's own default, shown as it is
            default, spec = defaults[f.name], dataclasses.replace(spec, default_text=None)
        kwargs = _argparse_kwargs(spec, hint, default, choices.get(f.name))
        parser.add_argument(flag_name(f.name), dest=f.name, **kwargs)


def values_from(cls: type, namespace: argparse.Namespace, **overrides: Any) -> dict[str, Any]:
    """The parsed values of `cls`'s flag fields (those the parser has), plus `overrides`."""
    values = {
        f.name: getattr(namespace, f.name) for f, _, _ in flag_fields(cls) if hasattr(namespace, f.name)
    }
    return {**values, **overrides}


def to_argv(cls: type, values: Mapping[str, Any]) -> list[str]:
    """Flags that parse back to `values` (a mapping of field name to value; None is left out)."""
    argv: list[str] = []
    for f, spec, hint in flag_fields(cls):
        if f.name not in values or values[f.name] is None:
            continue
        value, flag = values[f.name], flag_name(f.name)
        if _base_type(hint) is bool:
            argv.append(flag if value else "--no-" + flag[2:])
        elif _list_item_type(hint) is not None:
            items = [str(v) for v in value]
            if spec.nargs is not None:
                argv += [flag, *items] if items else []
            else:
                for item in items:
                    argv += [flag, item]
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, str(value)]
    return argv


# ---- internals ----------------------------------------------------------------------------------------
def _argparse_kwargs(
    spec: FlagSpec, hint: Any, default: Any, choices_override: Sequence[Any] | None
) -> dict[str, Any]:
    required = default is dataclasses.MISSING
    kwargs: dict[str, Any] = {"help": _help(spec, default, required)}
    if not required:
        kwargs["default"] = default
    base = _base_type(hint)
    if base is bool:
        kwargs["action"] = _BooleanFlag
        kwargs["required"] = required
        return kwargs
    item = _list_item_type(hint)
    if item is not None:
        base = item
        if spec.nargs is not None:
            kwargs["nargs"] = spec.nargs
        else:
            kwargs["action"] = "append"  # appends to a copy of the default
    choices = choices_override or spec.choices or _literal_choices(hint)
    if choices:
        kwargs["choices"] = tuple(choices)
        base = type(choices[0])
    if typing.get_origin(base) is dict or base is dict:
        base = _json_object
    kwargs["type"] = spec.type or base
    if spec.metavar is not None:
        kwargs["metavar"] = spec.metavar
    if required:
        kwargs["required"] = True
    return kwargs


def _help(spec: FlagSpec, default: Any, required: bool) -> str:
    if required or (spec.default_text is None and default in (None, "", [], {})):
        text = spec.help
    elif spec.default_text is not None:
        text = f"{spec.help} (default: {spec.default_text})"
    elif isinstance(default, bool):
        text = f"{spec.help} (default: {'on' if default else 'off'})"
    else:
        text = f"{spec.help} (default: {default})"
    return text.replace("%", "%%")  # argparse expands %-formats in help texts


def _without_none(hint: Any) -> Any:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


def _base_type(hint: Any) -> Any:
    hint = _without_none(hint)
    if typing.get_origin(hint) is typing.Literal:
        return type(typing.get_args(hint)[0])
    return hint


def _literal_choices(hint: Any) -> tuple[Any, ...] | None:
    hint = _without_none(hint)
    return typing.get_args(hint) if typing.get_origin(hint) is typing.Literal else None


def _list_item_type(hint: Any) -> Any:
    hint = _without_none(hint)
    if typing.get_origin(hint) in (list, tuple):
        return typing.get_args(hint)[0]
    return None


def _json_object(text: str) -> dict[str, Any]:
    try:
        return parse_json_object(text, "the value")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class _BooleanFlag(argparse.BooleanOptionalAction):
    """`--x / --no-x`, with the help text as given (argparse 3.11 appends its own default to it)."""

    def __init__(self, option_strings: Sequence[str], dest: str, help: str | None = None, **kwargs: Any):
        super().__init__(option_strings, dest, **kwargs)
        self.help = help
