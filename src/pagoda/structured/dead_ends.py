"""Refuse grammars with a dead end: a point where the output can neither go on nor end.

A request's EBNF or Lark grammar may, after some text, require a rule that can neither produce a
character nor be empty, as in ``root ::= "x" a | "y"`` with ``a ::= a``: once "x" is sampled no
token is allowed at all, and the engine would have nothing to sample from. (A rule that only
repeats, like ``a ::= "x" a``, is no dead end: it always allows "x", and max_tokens ends it; nor
is a void alternative that nothing leads into, like ``a`` in ``root ::= a | "y"``.)

This reads the grammar as xgrammar prints it (one ``name ::= body`` per line, lookaheads as
``(=...)``), computes for each rule whether it can be empty and whether it can emit a first
character (least fixed points; a rule is re-evaluated only when one it names changes), then walks
the rules reachable from the root: in each sequence, an item that can do neither, after an item
that emits, is a dead end. Linear in the grammar's size, up to the nesting of its groups.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

from pagoda.structured.valid_utf8 import _read_class, _read_string

_RULE = re.compile(r"([A-Za-z_][A-Za-z0-9_]*) ::= ")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_REPEAT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(-?\d*)\s*)?\}")  # {m}, {m,}, {m, n}; n = -1: unbounded


@dataclass(frozen=True)
class _Term:  # a string, a class or a builtin call
    nullable: bool
    emits: bool


@dataclass(frozen=True)
class _Ref:
    name: str


@dataclass(frozen=True)
class _Seq:
    items: tuple


@dataclass(frozen=True)
class _Alt:
    options: tuple


@dataclass(frozen=True)
class _Repeat:
    item: object
    min: int


def check_no_dead_ends(ebnf: str, root: str = "root") -> None:
    """Raise ValueError naming the rule where output could get stuck."""
    rules = _parse_rules(ebnf)
    if root not in rules:
        return  # xgrammar reports a missing root itself
    nullable, emits = _fixed_points(rules)
    seen, stack = {root}, [root]
    while stack:
        name = stack.pop()
        for seq in _sequences(rules[name]):
            after_text = False
            for item in seq.items:
                n, e = _value(item, nullable, emits)
                if after_text and not n and not e:
                    shown = str(item.name) if isinstance(item, _Ref) else "a group"
                    raise ValueError(
                        f"the grammar has a dead end: in rule {name}, {shown} can never produce any "
                        "text (its rules only refer to rules that cannot either), so output would get "
                        "stuck there"
                    )
                after_text = after_text or e
        for ref in _refs(rules[name]):
            if ref in rules and ref not in seen:
                seen.add(ref)
                stack.append(ref)


# ---- reading xgrammar's printed EBNF --------------------------------------------------------------------
def _parse_rules(ebnf: str) -> dict[str, object]:
    rules: dict[str, object] = {}
    for line in ebnf.splitlines():
        match = _RULE.match(line)
        if match is None:
            continue
        tokens = _tokens(line, match.end())
        rules[match.group(1)] = _parse_alt(tokens, 0)[0]
    return rules


def _tokens(text: str, i: int) -> list[object]:
    """Terms, names, and the punctuation '(', '(=', ')', '|', ('rep', min) of one rule's body."""
    out: list[object] = []
    n = len(text)
    while i < n:
        c = text[i]
        if c.isspace():
            i += 1
        elif c == '"':
            codepoints, i = _read_string(text, i + 1)
            out.append(_Term(nullable=not codepoints, emits=bool(codepoints)))
        elif c == "[":
            _, i = _read_class(text, i + 1)
            out.append(_Term(nullable=False, emits=True))
        elif c == "(":
            if text.startswith("(=", i):
                out.append("(=")
                i += 2
            else:
                out.append("(")
                i += 1
        elif c in ")|":
            out.append(c)
            i += 1
        elif c in "*?+":
            out.append(("rep", 1 if c == "+" else 0))
            i += 1
        elif c == "{":
            match = _REPEAT.match(text, i)
            if match is None:
                raise ValueError(f"unexpected repetition {text[i : i + 20]!r} in the grammar text")
            out.append(("rep", int(match.group(1))))
            i = match.end()
        else:
            match = _NAME.match(text, i)
            if match is None:
                raise ValueError(f"unexpected {text[i : i + 20]!r} in the grammar text")
            i = match.end()
            if text.startswith("(", i):  # a builtin call such as Token(...): it emits something
                depth = 0
                while i < n:
                    depth += {"(": 1, ")": -1}.get(text[i], 0)
                    i += 1
                    if depth == 0:
                        break
                out.append(_Term(nullable=False, emits=True))
            else:
                out.append(_Ref(match.group()))
    return out


def _parse_alt(tokens: list[object], i: int) -> tuple[object, int]:
    options = []
    while True:
        seq, i = _parse_seq(tokens, i)
        options.append(seq)
        if i < len(tokens) and tokens[i] == "|":
            i += 1
            continue
        return (_Alt(tuple(options)) if len(options) > 1 else options[0]), i


def _parse_seq(tokens: list[object], i: int) -> tuple[object, int]:
    items: list[object] = []
    while i < len(tokens) and tokens[i] not in ("|", ")"):
        token = tokens[i]
        if token == "(=":  # a lookahead: it constrains, it does not produce
            _, i = _parse_alt(tokens, i + 1)
            i += 1  # its ")"
            continue
        if token == "(":
            item, i = _parse_alt(tokens, i + 1)
            i += 1
        elif isinstance(token, tuple):
            raise ValueError("a repetition with nothing to repeat in the grammar text")
        else:
            item, i = token, i + 1
        while i < len(tokens) and isinstance(tokens[i], tuple):
            item = _Repeat(item, tokens[i][1])
            i += 1
        items.append(item)
    return _Seq(tuple(items)), i


# ---- the fixed points ----------------------------------------------------------------------------------
def _fixed_points(rules: dict[str, object]) -> tuple[dict[str, bool], dict[str, bool]]:
    nullable = dict.fromkeys(rules, False)
    emits = dict.fromkeys(rules, False)
    users: dict[str, set[str]] = defaultdict(set)
    for name, node in rules.items():
        for ref in _refs(node):
            users[ref].add(name)
    pending = list(rules)
    while pending:
        name = pending.pop()
        n, e = _value(rules[name], nullable, emits)
        if (n, e) != (nullable[name], emits[name]):
            nullable[name], emits[name] = n, e
            pending.extend(users[name])
    return nullable, emits


def _value(node: object, nullable: dict[str, bool], emits: dict[str, bool]) -> tuple[bool, bool]:
    """(nullable, can emit a first character) of a node, given the rules' current values."""
    if isinstance(node, _Term):
        return node.nullable, node.emits
    if isinstance(node, _Ref):
        return nullable.get(node.name, True), emits.get(node.name, True)  # unknown: xgrammar checks
    if isinstance(node, _Repeat):
        n, e = _value(node.item, nullable, emits)
        return n or node.min == 0, e
    if isinstance(node, _Alt):
        values = [_value(o, nullable, emits) for o in node.options]
        return any(v[0] for v in values), any(v[1] for v in values)
    assert isinstance(node, _Seq)
    all_nullable, can_emit = True, False
    for item in node.items:
        n, e = _value(item, nullable, emits)
        can_emit = can_emit or (all_nullable and e)
        all_nullable = all_nullable and n
        if not all_nullable:
            break
    return all_nullable, can_emit


def _sequences(node: object) -> list[_Seq]:
    found: list[_Seq] = []
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, _Seq):
            found.append(item)
            stack.extend(item.items)
        elif isinstance(item, _Repeat):
            stack.append(item.item)
        elif isinstance(item, _Alt):
            stack.extend(item.options)
    return found


def _refs(node: object) -> list[str]:
    found: list[str] = []
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, _Ref):
            found.append(item.name)
        elif isinstance(item, _Repeat):
            stack.append(item.item)
        elif isinstance(item, _Alt):
            stack.extend(item.options)
        elif isinstance(item, _Seq):
            stack.extend(item.items)
    return found
