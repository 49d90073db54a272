"""Random walks through grammar masks: every allowed path ends in valid output."""

from __future__ import annotations

import codecs
import json
import random
import re

import jsonschema
import pytest
from grammar_helpers import (
    JSON_SCHEMAS,
    REGEXES,
    TOKENIZER_VOCAB,
    allowed_ids,
    utf8,
    valid_utf8_prefix,
)

from pagoda.sampling_params import StructuredOutputs
from pagoda.structured import GrammarManager

# ---- random walks ------------------------------------------------------------------------------------

CHOICES = [
    ["yes", "no", "maybe"],
    ["a", "ab", "abc"],  # choices that are prefixes of each other
    ['say "hi"', "back\\slash", "new\nline", "tab\there", "emoji 😀", "[regex] (meta) *.+?^$|"],
]

# Grammars (EBNF or Lark) with an equivalent Python regex. (Not "<" ... ">": the EOS token's text,
# "<|endoftext|>", would match that, and xgrammar allows it there as text.)
GRAMMARS = [
    ('root ::= "(" [^()]* ")" | "{" [\\u00e0-\\U0010ffff]+ "}"', r"\([^()]*\)|\{[\u00e0-\U0010ffff]+\}"),
    ('root ::= "(" Regex("[^()]{1,5}") ")"', r"\([^()]{1,5}\)"),
    ('start: "(" TEXT ")"\nTEXT: /[^()]+/', r"\([^()]+\)"),
]

_CLOSERS = set('"}]>)')
WALK_SEEDS = range(6)
MANY_SEEDS = range(6, 150)


def random_walk(
    manager: GrammarManager, spec: StructuredOutputs, is_complete, seed: int, walks: int = 4
) -> list[str]:
    """Run ``walks`` sequences side by side in one batch bitmask (with an unconstrained row between them).

    Each step samples among the allowed tokens: uniformly, or now and then only among closing tokens (so
    walks end quickly) or only among tokens with non-ASCII bytes (so walks go through multi-byte
    characters, where U+D800-U+DFFF would show up if the grammar let them through). Checks at every step
    that EOS is allowed exactly when the text so far is a complete match, and that every allowed token
    keeps the text valid UTF-8 (complete or not yet).
    """
    rng = random.Random(seed)
    compiled = manager.compile(spec)
    token_bytes = manager.backend.token_bytes
    eos = manager.backend.stop_token_ids[0]
    closers = {i for i, b in enumerate(token_bytes) if b and set(b.decode("latin-1")) <= _CLOSERS}
    closers.add(eos)
    non_ascii = {i for i, b in enumerate(token_bytes) if b and max(b) >= 0x80}
    matchers = [compiled.new_matcher() for _ in range(walks)]
    decoders = [codecs.getincrementaldecoder("utf-8")() for _ in range(walks)]
    outputs: list[list[int]] = [[] for _ in range(walks)]
    bitmask = manager.allocate_bitmask(walks + 1)
    for _step in range(400):
        live = [i for i, m in enumerate(matchers) if not m.is_terminated()]
        if not live:
            break
        rows: list = [None] * (walks + 1)
        for i in live:
            rows[i + 1] = matchers[i]
        bitmask.zero_()
        assert manager.fill_bitmask(bitmask, rows)
        assert len(allowed_ids(bitmask, 0)) == bitmask.shape[1] * 32  # unconstrained row: all allowed
        for i in live:
            allowed = allowed_ids(bitmask, i + 1).tolist()
            assert len(allowed) > 0
            assert all(t == eos or token_bytes[t] for t in allowed), "special or padding id allowed"
            assert max(allowed) < TOKENIZER_VOCAB  # never a padding id past the tokenizer
            text = b"".join(token_bytes[t] for t in outputs[i])
            complete = is_complete(text)
            assert (eos in allowed) == complete, (text, complete)
            unfinished = decoders[i].getstate()[0]  # bytes of a character not yet complete
            invalid = [token_bytes[t] for t in allowed if not valid_utf8_prefix(unfinished + token_bytes[t])]
            assert not invalid, (text, invalid[:8])
            r = rng.random()
            pool = [t for t in allowed if t in (closers if r < 0.3 else non_ascii)] if r < 0.55 else []
            token = int(rng.choice(pool or allowed))
            assert matchers[i].accept_token(token)
            if token != eos:
                outputs[i].append(token)
                decoders[i].decode(token_bytes[token])
    assert all(m.is_terminated() for m in matchers), "random walk did not finish in 400 steps"
    return [utf8(b"".join(token_bytes[t] for t in out)) for out in outputs]


def _json_complete(schema: dict):
    validator = jsonschema.Draft202012Validator(schema)

    def check(text: bytes) -> bool:
        try:
            value = json.loads(utf8(text))
        except ValueError:  # also UnicodeDecodeError
            return False
        return validator.is_valid(value)

    return check


def _regex_complete(pattern: str):
    # DOTALL and ASCII make "." and \W, \s, \S mean what they mean in xgrammar.
    compiled = re.compile(pattern, re.DOTALL | re.ASCII)

    def check(text: bytes) -> bool:
        try:
            return compiled.fullmatch(utf8(text)) is not None
        except UnicodeDecodeError:
            return False

    return check


def _json_object_complete(text: bytes) -> bool:
    try:
        return isinstance(json.loads(utf8(text)), dict)
    except ValueError:
        return False


def walk_json_schema(manager: GrammarManager, name: str, seeds: range) -> None:
    schema = JSON_SCHEMAS[name]
    for seed in seeds:
        for text in random_walk(manager, StructuredOutputs(json=schema), _json_complete(schema), seed):
            jsonschema.validate(json.loads(text), schema)


def walk_json_object(manager: GrammarManager, seeds: range) -> None:
    for seed in seeds:
        for text in random_walk(manager, StructuredOutputs(json_object=True), _json_object_complete, seed):
            assert isinstance(json.loads(text), dict)


def walk_regex(manager: GrammarManager, pattern: str, seeds: range) -> None:
    complete = _regex_complete(pattern)
    for seed in seeds:
        for text in random_walk(manager, StructuredOutputs(regex=pattern), complete, seed):
            assert complete(text.encode()), text


def walk_choice(manager: GrammarManager, choices: list[str], seeds: range) -> set[str]:
    encoded = {c.encode("utf-8") for c in choices}
    seen = set()
    for seed in seeds:
        for text in random_walk(manager, StructuredOutputs(choice=choices), encoded.__contains__, seed):
            assert text in choices
            seen.add(text)
    return seen


def walk_grammar(manager: GrammarManager, grammar: str, pattern: str, seeds: range) -> None:
    complete = _regex_complete(pattern)
    for seed in seeds:
        for text in random_walk(manager, StructuredOutputs(grammar=grammar), complete, seed):
            assert complete(text.encode()), text


@pytest.mark.parametrize("name", sorted(JSON_SCHEMAS))
def test_random_walk_json_schema(manager: GrammarManager, name: str) -> None:
    walk_json_schema(manager, name, WALK_SEEDS)


def test_random_walk_json_object(manager: GrammarManager) -> None:
    walk_json_object(manager, WALK_SEEDS)


@pytest.mark.parametrize("pattern", REGEXES)
def test_random_walk_regex(manager: GrammarManager, pattern: str) -> None:
    walk_regex(manager, pattern, WALK_SEEDS)


@pytest.mark.parametrize("choices", CHOICES, ids=["plain", "prefixes", "escapes"])
def test_random_walk_choice(manager: GrammarManager, choices: list[str]) -> None:
    assert len(walk_choice(manager, choices, WALK_SEEDS)) > 1  # the walk explores all branches


@pytest.mark.parametrize(("grammar", "pattern"), GRAMMARS, ids=["ebnf", "ebnf_regex", "lark"])
def test_random_walk_grammar(manager: GrammarManager, grammar: str, pattern: str) -> None:
    walk_grammar(manager, grammar, pattern, WALK_SEEDS)


@pytest.mark.slow
def test_random_walks_many_seeds(manager: GrammarManager) -> None:
    """Every kind, many more seeds: the output is always strictly valid UTF-8 and matches the spec."""
    for name in JSON_SCHEMAS:
        walk_json_schema(manager, name, MANY_SEEDS)
    walk_json_object(manager, MANY_SEEDS)
    for pattern in REGEXES:
        walk_regex(manager, pattern, MANY_SEEDS)
    for choices in CHOICES:
        walk_choice(manager, choices, MANY_SEEDS)
    for grammar, pattern in GRAMMARS:
        walk_grammar(manager, grammar, pattern, MANY_SEEDS)


def test_ebnf_grammar_walk(manager: GrammarManager) -> None:
    grammar = 'root ::= item ("," item)*\nitem ::= [a-c] | "(" root ")"'
    spec = StructuredOutputs(grammar=grammar)

    def complete(text: bytes) -> bool:
        s = text.decode("utf-8", errors="replace")
        depth = 0
        for i, ch in enumerate(s):
            depth += ch == "("
            depth -= ch == ")"
            if depth < 0 or (ch in ",(" and (i + 1 == len(s) or s[i + 1] in ",)")):
                return False
        return depth == 0 and bool(s) and s[-1] not in ",("

    for text in random_walk(manager, spec, complete, seed=3):
        assert re.fullmatch(r"[a-c(),]+", text)
