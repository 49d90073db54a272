"""Restrict xgrammar grammars to output that is valid UTF-8.

xgrammar 0.2.9 (the latest release) can emit invalid UTF-8 in two ways:

* Character classes in its EBNF match UTF-8 bytes and take in the encodings of the UTF-16 surrogates
  U+D800-U+DFFF (ED A0 80 - ED BF BF), which UTF-8 forbids: a JSON string's ``[^"\\\\]``, a regex ``.``
  or ``\\S``, any negated class. (Every other invalid sequence, overlong or cut-off, is already refused.)
* ``Regex("...")`` rules, compiled lazily by a separate regex engine (JSON-schema ``pattern``,
  ``propertyNames`` and ``patternProperties`` produce them), also take in overlong forms (E0 80 80).
  With ``json_string=true`` they also write ``"``, ``\\`` and control characters raw, breaking the JSON.

So we rewrite the grammar text xgrammar prints: every class drops the surrogates, every ``Regex`` rule is
replaced by the EBNF of ``xgr.Grammar.from_regex`` (for a JSON string, with ``"``, ``\\`` and control
characters written as JSON escapes), a literal with a surrogate is an error, and so are constructs that
emit the bytes of arbitrary tokens (``TagDispatch``, ``ExcludeToken``, ...); ``Token(i)`` stays when
token ``i`` is valid UTF-8 by itself. The grammar then only allows whole, valid characters. Structural
tags keep their free text (``TagDispatch``: the model's own text between constrained parts).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import xgrammar as xgr

Ranges = tuple[tuple[int, int], ...]  # sorted, disjoint, non-adjacent code point ranges

_MAX_CODEPOINT = 0x10FFFF
_SURROGATES: Ranges = ((0xD800, 0xDFFF),)
# Characters a JSON string must escape, and the escape we write for each (one spelling per character).
_JSON_ESCAPED: Ranges = ((0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C))
_JSON_SHORT_ESCAPES = {
    0x22: '\\"',
    0x5C: "\\\\",
    0x08: "\\b",
    0x0C: "\\f",
    0x0A: "\\n",
    0x0D: "\\r",
    0x09: "\\t",
}

# The escapes xgrammar's printer writes (its PrintAsEscapedUTF8); any other escaped character stands for
# itself (it writes "\-" and "\]" in classes).
_SIMPLE_ESCAPES = {
    "'": 0x27,
    '"': 0x22,
    "?": 0x3F,
    "\\": 0x5C,
    "a": 0x07,
    "b": 0x08,
    "f": 0x0C,
    "n": 0x0A,
    "r": 0x0D,
    "t": 0x09,
    "v": 0x0B,
    "0": 0x00,
    "e": 0x1B,
}
# The printer writes "\x" with exactly 2 digits, but xgrammar's parser reads "\x" with any number of hex
# digits (its own "\x01a" reads back as U+01A): we read 2 and only ever write fixed-width \u / \U.
_HEX_DIGITS = {"x": 2, "u": 4, "U": 8}
_HEX = frozenset("0123456789abcdefABCDEF")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_RULE_NAME = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*) ::=", re.MULTILINE)
_REGEX_ARGS = {")": False, ", json_string=false)": False, ", json_string=true)": True}
# Escapes xgrammar's own printer writes and reads back; other special characters are written as \u.
_STRING_ESCAPES = {'"': '\\"', "\\": "\\\\"}
_CLASS_ESCAPES = {"\\": "\\\\", "]": "\\]", "-": "\\-"}


@dataclass(frozen=True)
class _Text:
    text: str


@dataclass(frozen=True)
class _String:
    codepoints: tuple[int, ...]


@dataclass(frozen=True)
class _Class:
    negated: bool
    ranges: Ranges  # as written, not normalized


@dataclass(frozen=True)
class _Regex:
    pattern: str
    json_string: bool


@dataclass(frozen=True)
class _Call:
    name: str
    text: str  # the whole call, e.g. "Token(3, 4)"


_Segment = _Text | _String | _Class | _Regex | _Call


# ---- reading xgrammar's printed EBNF --------------------------------------------------------------------


def _read_char(text: str, i: int) -> tuple[int, int]:
    """The code point at ``text[i]`` (an escape or a raw character) and the index after it."""
    if text[i] != "\\":
        return ord(text[i]), i + 1
    if i + 1 >= len(text):
        raise ValueError("grammar text ends inside an escape")
    kind = text[i + 1]
    width = _HEX_DIGITS.get(kind)
    if width is None:
        return _SIMPLE_ESCAPES.get(kind, ord(kind)), i + 2
    digits = text[i + 2 : i + 2 + width]
    if len(digits) != width or not set(digits) <= _HEX:
        raise ValueError(f"unexpected escape {text[i : i + 2 + width]!r} in the grammar text")
    return int(digits, 16), i + 2 + width


def _read_string(text: str, i: int) -> tuple[tuple[int, ...], int]:
    """The code points of the string literal opened at ``text[i - 1]``, and the index after it."""
    codepoints = []
    while True:
        if i >= len(text):
            raise ValueError("unterminated string literal in the grammar text")
        if text[i] == '"':
            return tuple(codepoints), i + 1
        codepoint, i = _read_char(text, i)
        codepoints.append(codepoint)


def _read_class(text: str, i: int) -> tuple[_Class, int]:
    """The character class opened at ``text[i - 1]``; an unescaped "-" between two items is a range."""
    negated = text.startswith("^", i)
    i += negated
    ranges = []
    while True:
        if i >= len(text):
            raise ValueError("unterminated character class in the grammar text")
        if text[i] == "]":
            return _Class(negated, tuple(ranges)), i + 1
        lo, i = _read_char(text, i)
        hi = lo
        if text.startswith("-", i) and i + 1 < len(text) and text[i + 1] != "]":
            hi, i = _read_char(text, i + 1)
        if lo > hi:
            raise ValueError(f"reversed character class range {lo:#x}-{hi:#x} in the grammar text")
        ranges.append((lo, hi))


def _call_end(ebnf: str, i: int) -> int:
    """The index of the ")" closing the call opened at ``ebnf[i]`` (nested parentheses and string
    literals, as TagDispatch's arguments have, are skipped)."""
    depth = 0
    while i < len(ebnf):
        c = ebnf[i]
        if c == '"':
            _, i = _read_string(ebnf, i + 1)
            continue
        if c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    raise ValueError("unterminated builtin call (...) in the grammar text")


def _segments(ebnf: str) -> Iterator[_Segment]:
    """Split printed EBNF into literals, classes, identifiers, builtin calls and the text between."""
    i = start = 0
    while i < len(ebnf):
        c = ebnf[i]
        if c not in '"[' and not (c.isascii() and (c.isalpha() or c == "_")):
            i += 1
            continue
        if start < i:
            yield _Text(ebnf[start:i])
        if c == '"':
            codepoints, i = _read_string(ebnf, i + 1)
            yield _String(codepoints)
        elif c == "[":
            char_class, i = _read_class(ebnf, i + 1)
            yield char_class
        else:
            match = _IDENTIFIER.match(ebnf, i)
            assert match is not None  # c starts an identifier
            name, i = match.group(), match.end()
            if not ebnf.startswith("(", i):
                yield _Text(name)
            elif name == "Regex" and ebnf.startswith('("', i):
                codepoints, i = _read_string(ebnf, i + 2)
                args = next((a for a in _REGEX_ARGS if ebnf.startswith(a, i)), None)
                if args is None:
                    raise ValueError(f"unexpected Regex arguments {ebnf[i : i + 40]!r} in the grammar text")
                yield _Regex("".join(map(chr, codepoints)), _REGEX_ARGS[args])
                i += len(args)
            else:
                close = _call_end(ebnf, i)
                yield _Call(name, ebnf[match.start() : close + 1])
                i = close + 1
        start = i
    if start < len(ebnf):
        yield _Text(ebnf[start:])


# ---- code point sets ------------------------------------------------------------------------------------


def _normalized(ranges: Sequence[tuple[int, int]]) -> Ranges:
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return tuple(merged)


def _complement(ranges: Ranges) -> Ranges:
    gaps, next_lo = [], 0
    for lo, hi in ranges:
        if lo > next_lo:
            gaps.append((next_lo, lo - 1))
        next_lo = hi + 1
    if next_lo <= _MAX_CODEPOINT:
        gaps.append((next_lo, _MAX_CODEPOINT))
    return tuple(gaps)


def _intersection(a: Ranges, b: Ranges) -> Ranges:
    return tuple(
        (max(lo1, lo2), min(hi1, hi2)) for lo1, hi1 in a for lo2, hi2 in b if max(lo1, lo2) <= min(hi1, hi2)
    )


def _minus(a: Ranges, b: Ranges) -> Ranges:
    return _intersection(a, _complement(b))


def _matched(char_class: _Class) -> Ranges:
    ranges = _normalized(char_class.ranges)
    return _complement(ranges) if char_class.negated else ranges


def _has_surrogate(codepoints: Sequence[int]) -> bool:
    return any(0xD800 <= cp <= 0xDFFF for cp in codepoints)


def _is_json_escaped(codepoint: int) -> bool:
    return codepoint < 0x20 or codepoint in (0x22, 0x5C)


# ---- writing EBNF ---------------------------------------------------------------------------------------


def _ebnf_char(codepoint: int, escapes: dict[str, str], special: str = "") -> str:
    char = chr(codepoint)
    if char in escapes:
        return escapes[char]
    if 0x20 <= codepoint <= 0x7E and char not in special:
        return char
    return f"\\u{codepoint:04x}" if codepoint <= 0xFFFF else f"\\U{codepoint:08x}"


def _ebnf_string(codepoints: Sequence[int]) -> str:
    return '"' + "".join(_ebnf_char(cp, _STRING_ESCAPES) for cp in codepoints) + '"'


def _ebnf_class(matched: Ranges, prefer_negated: bool) -> str:
    """A class matching exactly ``matched`` (non-empty), negated if that takes fewer ranges."""
    complement = _complement(matched)
    negated = len(complement) < len(matched) or (len(complement) == len(matched) and prefer_negated)
    items = []
    for lo, hi in complement if negated else matched:
        item = _ebnf_char(lo, _CLASS_ESCAPES, special='^["')
        if hi > lo:
            item += "-" + _ebnf_char(hi, _CLASS_ESCAPES, special='^["')
        items.append(item)
    return "[" + "^" * negated + "".join(items) + "]"


def _json_escape(codepoint: int) -> tuple[int, ...]:
    escape = _JSON_SHORT_ESCAPES.get(codepoint, f"\\u{codepoint:04x}")
    return tuple(map(ord, escape))


# ---- the rewrite ----------------------------------------------------------------------------------------


class _Rewriter:
    """One rewrite of one printed grammar; new rules (expanded regexes, JSON escapes) go at the end."""

    def __init__(self, ebnf: str, token_bytes: Sequence[bytes], allow_free_text: bool) -> None:
        self._ebnf = ebnf
        self._token_bytes = token_bytes
        self._allow_free_text = allow_free_text
        self._taken = set(_RULE_NAME.findall(ebnf))
        self._new_rules: list[str] = []
        self._escape_rules: dict[Ranges, str] = {}
        self.changed = False

    def rewrite(self) -> str:
        body = "".join(self._segment(s, json_string=False, rename={}) for s in _segments(self._ebnf))
        return body.rstrip("\n") + "\n" + "".join(rule + "\n" for rule in self._new_rules)

    def _segment(self, segment: _Segment, json_string: bool, rename: dict[str, str]) -> str:
        if isinstance(segment, _Text):
            return rename.get(segment.text, segment.text)
        if isinstance(segment, _String):
            if _has_surrogate(segment.codepoints):
                raise ValueError(
                    f"the literal {_ebnf_string(segment.codepoints)} contains a UTF-16 surrogate "
                    "(U+D800-U+DFFF), which is not valid UTF-8"
                )
            if json_string:
                escaped = tuple(
                    c
                    for cp in segment.codepoints
                    for c in (_json_escape(cp) if _is_json_escaped(cp) else (cp,))
                )
                return _ebnf_string(escaped)
            return _ebnf_string(segment.codepoints)
        if isinstance(segment, _Class):
            return self._class(segment, json_string)
        if isinstance(segment, _Regex):
            self.changed = True
            return "(" + self._expand_regex(segment) + ")"
        if segment.name == "Token":
            self._check_tokens(segment.text)
            return segment.text
        if segment.name == "TagDispatch" and self._allow_free_text:
            for inner in _segments(segment.text[len("TagDispatch(") : -1]):
                if isinstance(inner, _String) and _has_surrogate(inner.codepoints):
                    raise ValueError("a structural tag string contains a UTF-16 surrogate (U+D800-U+DFFF)")
            return segment.text
        raise ValueError(
            f"{segment.name}(...) is not supported in structured output: it emits the bytes of arbitrary "
            "tokens, which need not be valid UTF-8"
        )

    def _class(self, char_class: _Class, json_string: bool) -> str:
        matched = _matched(char_class)
        valid = _minus(matched, _SURROGATES)
        self.changed |= valid != matched
        if not json_string:
            if not valid:
                raise ValueError(
                    "a character class matches only UTF-16 surrogates (U+D800-U+DFFF), which are not valid UTF-8"
                )
            return _ebnf_class(valid, char_class.negated)
        plain, escaped = _minus(valid, _JSON_ESCAPED), _intersection(valid, _JSON_ESCAPED)
        parts = [_ebnf_class(plain, char_class.negated)] if plain else []
        if escaped:
            parts.append(self._escape_rule(escaped))
        if not parts:
            raise ValueError("a character class of a JSON-string regex matches no valid character")
        return parts[0] if len(parts) == 1 else "(" + " | ".join(parts) + ")"

    def _escape_rule(self, escaped: Ranges) -> str:
        """A rule matching the JSON escapes of the characters in ``escaped`` (shared by equal sets)."""
        if escaped not in self._escape_rules:
            name = self._new_name("json_escape")
            literals = (_ebnf_string(_json_escape(cp)) for lo, hi in escaped for cp in range(lo, hi + 1))
            self._new_rules.append(f"{name} ::= (" + " | ".join(literals) + ")")
            self._escape_rules[escaped] = name
        return self._escape_rules[escaped]

    def _expand_regex(self, regex: _Regex) -> str:
        """Rules for ``regex`` from ``xgr.Grammar.from_regex``, rewritten; returns the name of its root."""
        try:
            sub = str(xgr.Grammar.from_regex(regex.pattern))
        except RuntimeError as e:
            raise ValueError(f"invalid regex {regex.pattern!r}: {e}") from None
        prefix = self._new_name("regex") + "_"
        rename = {name: prefix + name for name in _RULE_NAME.findall(sub)}
        self._taken.update(rename.values())
        rules = "".join(self._segment(s, regex.json_string, rename) for s in _segments(sub))
        self._new_rules.append(rules.rstrip("\n"))
        return rename["root"]

    def _new_name(self, stem: str) -> str:
        number = 0
        while any(name.startswith(f"{stem}{number}") for name in self._taken):
            number += 1
        name = f"{stem}{number}"
        self._taken.add(name)
        return name

    def _check_tokens(self, call: str) -> None:
        for part in call[len("Token(") : -1].split(","):
            token_id = int(part)
            if not 0 <= token_id < len(self._token_bytes):
                raise ValueError(f"{call}: token {token_id} is not in the vocabulary")
            try:
                self._token_bytes[token_id].decode("utf-8")
            except UnicodeDecodeError:
                raise ValueError(
                    f"{call}: token {token_id} ({self._token_bytes[token_id]!r}) is not valid UTF-8 by itself"
                ) from None


def valid_utf8_ebnf(
    ebnf: str, token_bytes: Sequence[bytes] = (), *, allow_free_text: bool = False
) -> tuple[str, bool]:
    """Rewrite grammar text, as ``str(xgr.Grammar)`` prints it, to allow only valid UTF-8.

    Returns the new text (literals and classes written with fixed-width escapes, which xgrammar reads back
    exactly) and whether the grammar changed beyond that. ``token_bytes[i]`` are token ``i``'s bytes, for
    ``Token(...)``. Raises ValueError for a literal with a surrogate, a class of nothing but surrogates,
    an invalid regex in a ``Regex`` rule, or a construct that emits arbitrary bytes.

    ``allow_free_text`` keeps ``TagDispatch`` (the free text of a structural tag: any tokens until a
    trigger or an end string). Free text is the model's own unconstrained text, which may split a
    character over tokens as unconstrained output does; everything around it stays valid UTF-8.
    """
    rewriter = _Rewriter(ebnf, token_bytes, allow_free_text)
    return rewriter.rewrite(), rewriter.changed


def valid_utf8_grammar(
    grammar: xgr.Grammar, token_bytes: Sequence[bytes] = (), *, allow_free_text: bool = False
) -> xgr.Grammar:
    """``grammar`` restricted to valid UTF-8 (the same object if it needs no change); see ``valid_utf8_ebnf``."""
    ebnf, changed = valid_utf8_ebnf(str(grammar), token_bytes, allow_free_text=allow_free_text)
    return xgr.Grammar.from_ebnf(ebnf) if changed else grammar
