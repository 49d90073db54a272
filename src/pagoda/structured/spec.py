"""Backend-independent handling of a StructuredOutputs spec: validation, cache key, choice → grammar."""

from __future__ import annotations

import json
from typing import Any

import jsonschema

from pagoda.json_input import parse_json_object
from pagoda.sampling_params import StructuredOutputs

# A compile cache key: (kind, canonical text of the spec).
SpecKey = tuple[str, str]


def parse_json_schema(schema: dict[str, Any] | str) -> dict[str, Any]:
    """The schema as a dict, checked against its JSON Schema metaschema (latest draft unless $schema says)."""
    schema = parse_json_object(schema, "structured_outputs.json")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "(root)"
        raise ValueError(
            f"structured_outputs.json is not a valid JSON schema at {where}: {e.message}"
        ) from None
    except RecursionError:  # RequestLimits bounds nesting; this is the last line of defence
        raise ValueError("structured_outputs.json is nested too deeply") from None
    _check_local_refs(schema)
    return schema


_REF_KEYWORDS = ("$ref", "$dynamicRef", "$recursiveRef")


def _check_local_refs(schema: dict[str, Any]) -> None:
    """Only references into the schema itself ('#...'): a schema must never make the server read a
    file or fetch a URL, and xgrammar would silently treat an unresolved reference as any value."""
    stack: list[Any] = [schema]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            for keyword in _REF_KEYWORDS:
                ref = item.get(keyword)
                if isinstance(ref, str) and not ref.startswith("#"):
                    raise ValueError(
                        f"structured_outputs: {keyword} {ref!r:.200} is not a reference into the schema "
                        "itself ('#/...'); schemas are never read from files or URLs"
                    )
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def parse_structural_tag(tag: dict[str, Any] | str) -> dict[str, Any]:
    """The structural tag as a dict ``{"type": "structural_tag", "format": {...}}``; its formats are
    checked when it is compiled."""
    tag = parse_json_object(tag, "structured_outputs.structural_tag")
    if tag.get("type") != "structural_tag" or not isinstance(tag.get("format"), dict):
        raise ValueError(
            'structured_outputs.structural_tag must be {"type": "structural_tag", "format": {...}}'
        )
    _check_local_refs(tag)  # the JSON schemas in its formats
    return tag


def spec_key(spec: StructuredOutputs) -> SpecKey:
    """Cache key: equal for specs that compile to the same grammar (e.g. dict schemas up to key order)."""
    kind = spec.kind
    if spec.json is not None:
        canonical = json.dumps(
            parse_json_schema(spec.json), sort_keys=True, separators=(",", ":"), ensure_ascii=False
        )
    elif spec.structural_tag is not None:
        canonical = json.dumps(
            parse_structural_tag(spec.structural_tag),
            sort_keys=True,
            separators=(",", ":"),
            ensure_ascii=False,
        )
    elif spec.choice is not None:
        canonical = json.dumps(list(spec.choice), ensure_ascii=False)
    elif kind in ("regex", "grammar"):
        canonical = getattr(spec, kind)
        if not isinstance(canonical, str):
            raise ValueError(f"structured_outputs.{kind} must be a string, got {type(canonical).__name__}")
    else:
        canonical = ""
    try:
        canonical.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"structured_outputs.{kind} contains a lone UTF-16 surrogate (U+{ord(canonical[e.start]):04X}), "
            "which is not valid Unicode text"
        ) from None
    return kind, canonical


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar matching exactly one of ``choices``.

    ``json.dumps(ensure_ascii=False)`` escapes exactly what an EBNF string literal needs (quote, backslash,
    control characters) and keeps other characters raw (``\\uXXXX`` surrogate pairs would break emoji).
    """
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def is_ebnf(grammar: str) -> bool:
    """EBNF (GBNF) rules use ``::=``; anything else is taken as Lark syntax, as vLLM accepts both."""
    return "::=" in grammar
