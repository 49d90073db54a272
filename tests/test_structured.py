"""Structured-output grammar layer: compile, cache, async compile, masking walks, rollback, jump-forward."""

from __future__ import annotations

import codecs
import functools
import json
import random
import re
import string
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch
import xgrammar as xgr
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from pagoda.sampling_params import StructuredOutputs
from pagoda.structured import GrammarConfig, GrammarManager, XGrammarBackend, spec_key
from pagoda.structured.valid_utf8 import valid_utf8_ebnf, valid_utf8_grammar
from pagoda.structured.xgrammar_backend import _json_schema_grammar

EOS = "<|endoftext|>"
TOKENIZER_VOCAB = 400
MODEL_VOCAB = 448  # lm_head rows: more than the tokenizer's vocabulary, as in padded real models

_CORPUS = [
    '{"name": "Alice", "age": 30, "tags": ["a", "b"], "address": {"street": "Main St", "city": "Paris"}}',
    '{"id": 12, "valid": true, "score": -0.5e3, "items": [{"sku": "AB-123", "qty": 2}], "note": null}',
    "The quick brown fox jumps over the lazy dog; jumping foxes are quicker than dogs. 0123456789",
    "user@example.com admin@pagoda.org false true null key value string number integer",
]


def build_tokenizer(directory: Path, vocab_size: int = TOKENIZER_VOCAB) -> PreTrainedTokenizerFast:
    """A byte-level BPE (256 byte tokens + merges + an EOS special token) saved as a HF folder."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 20, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS).save_pretrained(str(directory))
    return AutoTokenizer.from_pretrained(str(directory))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerFast:
    tok = build_tokenizer(tmp_path_factory.mktemp("bpe"))
    assert len(tok) == TOKENIZER_VOCAB < MODEL_VOCAB
    return tok


@pytest.fixture(scope="module")
def manager(tokenizer: PreTrainedTokenizerFast):
    mgr = GrammarManager.from_tokenizer(tokenizer, vocab_size=MODEL_VOCAB)
    # One token per byte value, so that any byte sequence, valid UTF-8 or not, can be generated.
    assert set(mgr.backend.token_bytes) >= {bytes([b]) for b in range(256)}
    yield mgr
    mgr.shutdown()


def allowed_ids(bitmask: torch.Tensor, row: int = 0) -> np.ndarray:
    words = bitmask[row].numpy().view(np.uint32)
    bits = (words[:, None] >> np.arange(32, dtype=np.uint32)) & 1
    return np.nonzero(bits.reshape(-1))[0]


def utf8(data: bytes) -> str:
    return data.decode("utf-8")  # strict: no surrogates, overlong forms or stray bytes


# Every valid UTF-8 prefix becomes valid text with one of these appended (the second byte of a character
# is 80, 90 or A0 at the lowest; later ones 80).
_COMPLETIONS = [b""] + [first + b"\x80" * k for first in (b"\x80", b"\x90", b"\xa0") for k in range(3)]


@functools.lru_cache(maxsize=1 << 16)
def valid_utf8_prefix(data: bytes) -> bool:
    """Whether ``data`` is valid UTF-8 or the start of it. (Python's incremental decoder can't tell: it
    accepts b"\\xed\\xa0", the start of a surrogate, as an unfinished character.)"""
    for completion in _COMPLETIONS:
        try:
            (data + completion).decode("utf-8")
        except UnicodeDecodeError:
            continue
        return True
    return False


def text_of(manager: GrammarManager, ids: list[int]) -> str:
    return utf8(b"".join(manager.backend.token_bytes[t] for t in ids))


# ---- compile -----------------------------------------------------------------------------------------

ALL_KINDS = [
    StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}),
    StructuredOutputs(json='{"type": "array", "items": {"type": "boolean"}}'),
    StructuredOutputs(regex=r"[0-9]{3}-[a-z]+"),
    StructuredOutputs(choice=["yes", "no"]),
    StructuredOutputs(grammar='root ::= "a" ("b" | "c")*'),
    StructuredOutputs(grammar='start: "x" NUMBER\n%import common.NUMBER'),
    StructuredOutputs(json_object=True),
]


@pytest.mark.parametrize("spec", ALL_KINDS, ids=lambda s: s.kind)
def test_compile_each_kind(manager: GrammarManager, spec: StructuredOutputs) -> None:
    matcher = manager.compile(spec).new_matcher()
    bitmask = manager.allocate_bitmask(1)
    matcher.fill_bitmask(bitmask, 0)
    allowed = allowed_ids(bitmask)
    assert 0 < len(allowed) < manager.vocab_size
    assert not matcher.is_terminated()


def test_json_object_allows_only_objects(manager: GrammarManager, tokenizer) -> None:
    matcher = manager.compile(StructuredOutputs(json_object=True)).new_matcher()
    bitmask = manager.allocate_bitmask(1)
    matcher.fill_bitmask(bitmask, 0)
    firsts = {manager.backend.token_bytes[t][:1] for t in allowed_ids(bitmask)}
    assert firsts <= {b"{", b" ", b"\n", b"\t", b"\r"}


@pytest.mark.parametrize(
    ("spec", "fragments"),
    [
        (StructuredOutputs(json="{not json"), ["structured_outputs.json", "not valid JSON"]),
        (StructuredOutputs(json='["a list"]'), ["must be a JSON object"]),
        (StructuredOutputs(json={"type": "strin"}), ["not a valid JSON schema", "strin"]),
        (
            StructuredOutputs(json={"type": "object", "properties": {"a": {"minLength": "three"}}}),
            ["properties/a/minLength", "three"],
        ),
        (
            StructuredOutputs(json={"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}),
            ["invalid structured_outputs.json", "missing"],
        ),
        (StructuredOutputs(regex="a(b"), ["invalid structured_outputs.regex", "parenthesis"]),
        (StructuredOutputs(regex="[z-a]"), ["invalid structured_outputs.regex", "lower bound"]),
        (StructuredOutputs(grammar='root ::= "a" | '), ["invalid structured_outputs.grammar", "column"]),
        (StructuredOutputs(grammar="root ::= undefined_rule"), ["undefined_rule"]),
        (StructuredOutputs(grammar="start: missing_rule"), ["read as Lark", "missing_rule"]),
        # Grammars that could only be met with invalid UTF-8, or could emit arbitrary bytes.
        (
            StructuredOutputs(grammar='root ::= "a" | "\\ud800"'),
            ["invalid structured_outputs.grammar", "surrogate"],
        ),
        (
            StructuredOutputs(grammar='root ::= "a" | [\\ud800-\\udfff]'),
            ["grammar", "only UTF-16 surrogates"],
        ),
        (StructuredOutputs(regex="a|\\ud800"), ["invalid structured_outputs.regex", "surrogate"]),
        (
            StructuredOutputs(json={"type": "string", "pattern": "^\\udfff$"}),
            ["structured_outputs.json", "surrogate"],
        ),
        (
            StructuredOutputs(json={"type": "string", "pattern": "^(a$"}),
            ["structured_outputs.json", "'^(a$'"],
        ),
        (
            StructuredOutputs(grammar='root ::= TagDispatch(("<a>", r))\nr ::= "x"'),
            ["TagDispatch", "need not be valid UTF-8"],
        ),
        (StructuredOutputs(grammar='root ::= "a" ExcludeToken(5)'), ["ExcludeToken(...) is not supported"]),
    ],
)
def test_invalid_spec_raises_value_error_naming_the_problem(
    manager: GrammarManager, spec: StructuredOutputs, fragments: list[str]
) -> None:
    with pytest.raises(ValueError) as info:
        manager.compile(spec)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, message
    assert not re.search(r"\.cc:\d+", message), message  # no C++ source locations leak to users


def test_backend_rejects_bad_configuration(tokenizer) -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        XGrammarBackend(tokenizer, vocab_size=0)
    with pytest.raises(ValueError, match="eos_token_ids"):
        XGrammarBackend(tokenizer, vocab_size=MODEL_VOCAB, eos_token_ids=[MODEL_VOCAB + 5])
    with pytest.raises(ValueError, match="eos_token_ids"):
        XGrammarBackend(tokenizer, eos_token_ids=[-1])
    with pytest.raises(ValueError, match="unknown grammar backend"):
        GrammarConfig(backend="outlines")
    with pytest.raises(ValueError, match="cache_size"):
        GrammarConfig(cache_size=0)


# ---- cache and async compile -------------------------------------------------------------------------


def test_compile_cache_hits(tokenizer) -> None:
    mgr = GrammarManager.from_tokenizer(tokenizer, vocab_size=MODEL_VOCAB, config=GrammarConfig(cache_size=2))
    try:
        schema = {"type": "object", "properties": {"x": {"type": "string"}, "y": {"type": "number"}}}
        reordered = {"properties": {"y": {"type": "number"}, "x": {"type": "string"}}, "type": "object"}
        first = mgr.compile(StructuredOutputs(json=schema))
        assert mgr.compile(StructuredOutputs(json=schema)) is first
        assert mgr.compile(StructuredOutputs(json=reordered)) is first
        assert mgr.compile(StructuredOutputs(json=json.dumps(reordered, indent=2))) is first
        assert spec_key(StructuredOutputs(json=schema)) == spec_key(StructuredOutputs(json=reordered))
        other = mgr.compile(StructuredOutputs(regex="x"))
        assert other is not first
        assert mgr.compile(StructuredOutputs(choice=["x"])) is not other  # same text, other kind
        # cache_size=2: the schema was least recently used and has been evicted.
        assert mgr.cached_specs() == 2
        assert mgr.compile(StructuredOutputs(json=schema)) is not first
    finally:
        mgr.shutdown()


class _BlockingBackend:
    """Wraps a backend so that compile waits until released: proves the caller never waits for it."""

    def __init__(self, inner: XGrammarBackend) -> None:
        self.inner = inner
        self.release = threading.Event()
        self.calls = 0
        self.vocab_size = inner.vocab_size
        self.token_bytes = inner.token_bytes

    def compile(self, spec: StructuredOutputs):
        self.calls += 1
        if not self.release.wait(timeout=30):
            raise TimeoutError("test never released the compile")
        return self.inner.compile(spec)

    def fill_bitmasks(self, matchers, bitmask, rows) -> None:
        self.inner.fill_bitmasks(matchers, bitmask, rows)


def test_async_compile_returns_future_without_blocking(tokenizer) -> None:
    backend = _BlockingBackend(XGrammarBackend(tokenizer, vocab_size=MODEL_VOCAB))
    mgr = GrammarManager(backend, compile_workers=2)
    try:
        spec = StructuredOutputs(regex="[ab]+")
        start = time.monotonic()
        future = mgr.compile_async(spec)
        bad = mgr.compile_async(StructuredOutputs(regex="(("))
        assert time.monotonic() - start < 5  # returned while both compiles are still held
        assert isinstance(future, Future)
        assert not future.done() and not bad.done()
        assert mgr.compile_async(spec) is future  # in-flight compile is shared, not repeated
        backend.release.set()
        compiled = future.result(timeout=30)
        assert compiled.new_matcher().accept_token(backend.token_bytes.index(b"a"))
        assert isinstance(bad.exception(timeout=30), ValueError)
        assert backend.calls == 2
    finally:
        backend.release.set()
        mgr.shutdown()


def test_malformed_spec_fails_before_queueing(manager: GrammarManager) -> None:
    with pytest.raises(ValueError, match="not valid JSON"):
        manager.compile_async(StructuredOutputs(json="{"))
    for spec in (
        StructuredOutputs(choice=["ok", "lone \udc00"]),
        StructuredOutputs(regex="a\ud800"),
        StructuredOutputs(json={"const": "\ud83d"}),
        StructuredOutputs(json='{"const": "\\ud83d"}'),  # an escaped lone surrogate in the JSON text
    ):
        with pytest.raises(
            ValueError, match=f"structured_outputs.{spec.kind} contains a lone UTF-16 surrogate"
        ):
            manager.compile_async(spec)
    # A surrogate pair escaped in JSON text is one character, not a lone surrogate.
    assert manager.compile_async(StructuredOutputs(json='{"const": "\\ud83d\\ude00"}')).result(timeout=30)


# ---- random walks ------------------------------------------------------------------------------------

JSON_SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 6}, "zip": {"type": "integer"}},
                "required": ["city", "zip"],
            },
        },
        "required": ["name", "address"],
    },
    "array_enum": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue", 7, None]}, "maxItems": 4},
            "mode": {"const": "fast"},
        },
        "required": ["tags", "mode"],
    },
    "numbers": {
        "type": "object",
        "properties": {
            "count": {"type": "integer", "minimum": -5, "maximum": 120},
            "ratio": {"type": "number"},
            "ok": {"type": "boolean"},
        },
        "required": ["count", "ratio", "ok"],
    },
    "optional_fields": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "nickname": {"type": "string", "maxLength": 5},
            "extra": {"type": ["string", "null"], "maxLength": 4},
        },
        "required": ["id"],
    },
    "string_pattern": {
        "type": "object",
        "properties": {
            "sku": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
            "email": {"type": "string", "pattern": "^[a-z]{1,6}@[a-z]{1,6}\\.(com|org)$"},
        },
        "required": ["sku", "email"],
    },
    "array_of_objects_ref": {
        "type": "array",
        "items": {"$ref": "#/$defs/point"},
        "minItems": 1,
        "maxItems": 3,
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                "required": ["x", "y"],
            }
        },
    },
    "any_of": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 3}, {"type": "null"}]},
    "free_text": {
        "type": "object",
        "properties": {
            "note": {"type": "string"},
            "code": {"type": "string", "pattern": "^[^,]{1,6}$"},
        },
        "required": ["note", "code"],
    },
    "pattern_keys": {
        "type": "object",
        "patternProperties": {"^[^,]{1,4}$": {"type": "integer"}},
        "additionalProperties": False,
    },
    "property_names": {
        "type": "object",
        "propertyNames": {"pattern": "^[^,]{1,4}$"},
        "additionalProperties": {"type": "boolean"},
    },
}

REGEXES = [
    r"[0-9]{3}-[a-z]+",
    r"(cat|dog|bird)s?( and (cat|dog|bird)s?)*",
    r"[a-z]{1,8}@[a-z]{1,8}\.(com|org|net)",
    r"-?(0|[1-9][0-9]{0,5})(\.[0-9]{1,3})?",
    r"[A-Fa-f0-9]{8}",
    r"héllo (wörld|мир|世界)!",
    # Classes that take in U+D800-U+DFFF in xgrammar unless rewritten; Python reads them alike here.
    r".{1,6}",
    r"[^a-z]{2,5}",
    r"x[\u0080-\U0010ffff]{1,3}",
    r"\W{1,4}",
    r"<[\s\S]{0,4}>",
]

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


# ---- valid UTF-8 only ---------------------------------------------------------------------------------

# (spec, ASCII text that leads into free text) for every kind; xgrammar 0.2.9 alone lets all of these emit
# the UTF-8 encoding of a surrogate.
FREE_TEXT = [
    (StructuredOutputs(json={"type": "string"}), '"'),
    (StructuredOutputs(json={"type": "string", "maxLength": 5}), '"'),
    (StructuredOutputs(json={"type": "string", "pattern": "^[^,]+$"}), '"'),
    (StructuredOutputs(json={"type": "object", "propertyNames": {"pattern": "^[^,]+$"}}), '{"'),
    (StructuredOutputs(json={"type": "object", "patternProperties": {"^[^,]+$": {"type": "null"}}}), '{"'),
    (StructuredOutputs(json_object=True), '{"'),
    (StructuredOutputs(json_object=True), '{"a": ["'),
    (StructuredOutputs(regex=".+"), ""),
    (StructuredOutputs(regex="[^a]+"), ""),
    (StructuredOutputs(regex=r"\S+"), ""),
    (StructuredOutputs(regex=r"\W+"), ""),
    (StructuredOutputs(regex=r"[\s\S]+"), ""),
    (StructuredOutputs(regex=r"x[\u0100-\uffff]+"), "x"),
    (StructuredOutputs(grammar="root ::= [^a]+"), ""),
    (StructuredOutputs(grammar=r"root ::= [\ud000-\ue000]+"), ""),
    (StructuredOutputs(grammar='root ::= "x" Regex("[^a]+")'), "x"),
    (StructuredOutputs(grammar="start: /[^a]+/"), ""),
    (StructuredOutputs(grammar='start: "x" ANY+\nANY: /./'), "x"),
]


@pytest.mark.parametrize(
    ("spec", "prefix"), FREE_TEXT, ids=lambda v: v.kind if isinstance(v, StructuredOutputs) else ""
)
def test_free_text_never_allows_surrogates(
    manager: GrammarManager, spec: StructuredOutputs, prefix: str
) -> None:
    """After byte ED (lead byte of U+D000-U+DFFF) only 80-9F may follow; A0-BF would start a surrogate."""
    token_bytes = manager.backend.token_bytes
    byte_token = {b[0]: i for i, b in enumerate(token_bytes) if len(b) == 1}
    matcher = manager.compile(spec).new_matcher()
    assert all(matcher.accept_token(byte_token[b]) for b in prefix.encode())
    bitmask = manager.allocate_bitmask(1)
    matcher.fill_bitmask(bitmask, 0)
    assert byte_token[0xED] in allowed_ids(bitmask)  # U+D000-U+D7FF stay allowed
    assert matcher.accept_token(byte_token[0xED])
    matcher.fill_bitmask(bitmask, 0)
    assert {token_bytes[t][0] for t in allowed_ids(bitmask)} == set(range(0x80, 0xA0))
    assert not any(matcher.accept_token(byte_token[b]) for b in range(0xA0, 0xC0))
    assert matcher.accept_token(byte_token[0x9F]) and matcher.accept_token(byte_token[0xBF])  # U+D7FF


@pytest.fixture(scope="module")
def byte_compiler() -> xgr.GrammarCompiler:
    """A compiler for a vocabulary of the 256 single bytes plus a stop token (id 256)."""
    vocab = [bytes([b]) for b in range(256)] + [b"</s>"]
    info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, stop_token_ids=[256])
    return xgr.GrammarCompiler(info, cache_enabled=False)


def _one_char_strings() -> list[bytes]:
    """Byte strings that are, or nearly are, one UTF-8 character: all 1- and 2-byte strings, and 3- and
    4-byte ones around every lead byte's limits (overlong, surrogate, past U+10FFFF)."""
    strings = [bytes([a]) for a in range(256)] + [
        bytes([a, b]) for a in range(0xC0, 0x100) for b in range(256)
    ]
    strings += [
        bytes([a, b, c])
        for a in range(0xE0, 0xF0)
        for b in range(0x80, 0xC0)
        for c in (0x7F, 0x80, 0xBF, 0xC0)
    ]
    strings += [
        bytes([a, b, 0x80, d]) for a in range(0xF0, 0xF8) for b in range(0x7F, 0xC1) for d in (0x80, 0xBF)
    ]
    return strings


def _is_one_char(data: bytes) -> bool:
    try:
        return len(data.decode("utf-8")) == 1
    except UnicodeDecodeError:
        return False


@pytest.mark.parametrize(
    "grammar",
    [
        xgr.Grammar.from_ebnf("root ::= [^,]"),
        xgr.Grammar.from_ebnf(r"root ::= [\0-+\--\U0010ffff]"),  # positive, spanning the surrogates
        xgr.Grammar.from_ebnf('root ::= Regex("[^,]")'),  # lazy regex: also overlong forms without the fix
        xgr.Grammar.from_regex("[^,]"),
        xgr.Grammar.from_lark("start: /[^,]/"),
    ],
    ids=["ebnf_negated", "ebnf_range", "ebnf_lazy_regex", "regex", "lark"],
)
def test_grammar_accepts_exactly_the_valid_characters(byte_compiler, grammar: xgr.Grammar) -> None:
    """Each grammar is "any one character but a comma": byte by byte, it must accept exactly the strict
    UTF-8 encodings of those characters."""
    matcher = xgr.GrammarMatcher(byte_compiler.compile_grammar(valid_utf8_grammar(grammar)))
    wrong = []
    for data in _one_char_strings():
        matcher.reset()
        accepted = all(matcher.accept_token(b) for b in data) and matcher.accept_token(256)
        if accepted != (_is_one_char(data) and data != b","):
            wrong.append(data.hex())
    assert not wrong, wrong[:10]


def test_json_string_pattern_escapes_what_json_requires(byte_compiler) -> None:
    """xgrammar 0.2.9 writes '"', '\\' and control characters matched by a pattern raw, which breaks the
    JSON; the rewrite writes them as JSON escapes, so the decoded string is what matches the pattern."""
    schema = {"type": "string", "pattern": "^[^,]{1,2}$"}
    assert "Regex(" in str(xgr.Grammar.from_json_schema(schema))  # compiled lazily without the rewrite
    matcher = xgr.GrammarMatcher(byte_compiler.compile_grammar(_json_schema_grammar(schema, True, True)))

    def accepts(text: str) -> bool:
        matcher.reset()
        return all(matcher.accept_token(b) for b in text.encode()) and matcher.accept_token(256)

    for value in ["x", '"', "\\", "\n", "\x1f", "\x7f", "é😀", '\t"']:
        text = json.dumps(value, ensure_ascii=False)
        assert accepts(text), text
        jsonschema.validate(json.loads(text), schema)
    for text in ['"""', '"\\"', '"\n"', '"\\u0022"', '"\\u000a"', '","', '"abc"']:
        assert not accepts(text), text  # raw, non-canonical escape, comma, too long


def test_token_references_must_be_valid_utf8(manager: GrammarManager) -> None:
    token_bytes = manager.backend.token_bytes
    lead_byte = token_bytes.index(b"\xc3")  # half of "é"
    with pytest.raises(ValueError, match=rf"Token\({lead_byte}\).*not valid UTF-8 by itself"):
        manager.compile(StructuredOutputs(grammar=f'start: "a" <[{lead_byte}]>'))
    whole = token_bytes.index(b"b")
    matcher = manager.compile(StructuredOutputs(grammar=f'start: "a" <[{whole}]> /[^a]/')).new_matcher()
    assert matcher.accept_token(token_bytes.index(b"a")) and matcher.accept_token(whole)


def test_rewrite_keeps_literals_exact(manager: GrammarManager) -> None:
    """xgrammar prints U+0001 followed by "a" as "\\x01a", which it reads back as U+01A; the rewrite
    writes fixed-width escapes instead."""
    text, changed = valid_utf8_ebnf(str(xgr.Grammar.from_ebnf('root ::= "\\u0001a" | [^b]')))
    assert changed and '"\\u0001a"' in text
    token_bytes = manager.backend.token_bytes
    matcher = manager.compile(StructuredOutputs(grammar='root ::= "\\u0001a" | [^b]')).new_matcher()
    assert matcher.accept_token(token_bytes.index(b"\x01")) and matcher.accept_token(token_bytes.index(b"a"))
    assert matcher.accept_token(manager.backend.stop_token_ids[0])


DIFFERENTIAL = [
    'root ::= ([^,] | "," [\\u0100-\\U0010ffff])+',
    'start: /[^x]{1,4}/ ("," /\\\\S+/)*',
    "regex:(.|\\W)+",
    {
        "type": "object",
        "properties": {"s": {"type": "string"}, "t": {"type": "array", "items": {"type": "string"}}},
    },
]


@pytest.mark.parametrize("source", DIFFERENTIAL, ids=["ebnf", "lark", "regex", "json"])
def test_rewrite_removes_exactly_the_invalid_utf8(manager: GrammarManager, tokenizer, source) -> None:
    """Walk the rewritten grammar beside xgrammar's own: at every step the allowed tokens are xgrammar's
    minus exactly those that would make the text invalid UTF-8."""
    if isinstance(source, dict):
        original = xgr.Grammar.from_json_schema(source)
    elif source.startswith("regex:"):
        original = xgr.Grammar.from_regex(source.removeprefix("regex:"))
    elif "::=" in source:
        original = xgr.Grammar.from_ebnf(source)
    else:
        original = xgr.Grammar.from_lark(source)
    eos = tokenizer.eos_token_id
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=MODEL_VOCAB, stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    token_bytes = manager.backend.token_bytes
    non_ascii = [i for i, b in enumerate(token_bytes) if b and max(b) >= 0x80]
    bitmask = xgr.allocate_token_bitmask(2, MODEL_VOCAB)
    for seed in range(4):
        rng = random.Random(seed)
        theirs = xgr.GrammarMatcher(compiler.compile_grammar(original))
        ours = xgr.GrammarMatcher(compiler.compile_grammar(valid_utf8_grammar(original)))
        decoder = codecs.getincrementaldecoder("utf-8")()
        for _step in range(60):
            theirs.fill_next_token_bitmask(bitmask, 0)
            ours.fill_next_token_bitmask(bitmask, 1)
            unfinished = decoder.getstate()[0]
            expected = [
                t
                for t in allowed_ids(bitmask, 0).tolist()
                if t == eos or valid_utf8_prefix(unfinished + token_bytes[t])
            ]
            allowed = allowed_ids(bitmask, 1).tolist()
            assert allowed == expected
            pool = [t for t in allowed if t in non_ascii] if rng.random() < 0.5 else []
            token = int(rng.choice(pool or allowed))
            if token == eos:
                break
            assert theirs.accept_token(token) and ours.accept_token(token)
            decoder.decode(token_bytes[token])


# ---- EOS, masks, rollback ----------------------------------------------------------------------------


def test_eos_only_where_grammar_may_end_and_after_termination(manager: GrammarManager, tokenizer) -> None:
    matcher = manager.compile(StructuredOutputs(regex="ab")).new_matcher()
    eos = tokenizer.eos_token_id
    bitmask = manager.allocate_bitmask(1)
    ids = tokenizer.encode("ab", add_special_tokens=False)
    for token in ids:
        matcher.fill_bitmask(bitmask, 0)
        assert eos not in allowed_ids(bitmask)
        assert matcher.accept_token(token)
    matcher.fill_bitmask(bitmask, 0)
    assert list(allowed_ids(bitmask)) == [eos]
    assert not matcher.accept_token(ids[0])  # rejected token leaves the state unchanged
    assert matcher.accept_token(eos)
    assert matcher.is_terminated()
    assert not matcher.accept_token(eos)
    assert matcher.jump_forward_string() == ""
    matcher.fill_bitmask(bitmask, 0)  # past the end: only the stop token, no error
    assert list(allowed_ids(bitmask)) == [eos]


def test_bitmask_works_with_xgrammar_apply(manager: GrammarManager, tokenizer) -> None:
    matcher = manager.compile(StructuredOutputs(choice=["true", "false"])).new_matcher()
    bitmask = manager.allocate_bitmask(2)
    manager.fill_bitmask(bitmask, [None, matcher])
    logits = torch.randn(2, MODEL_VOCAB, generator=torch.Generator().manual_seed(0))
    original = logits.clone()
    xgr.apply_token_bitmask_inplace(logits, bitmask)
    assert torch.equal(logits[0], original[0])
    allowed = set(allowed_ids(bitmask, 1).tolist())
    assert all(not torch.isinf(logits[1, t]) for t in allowed)
    assert torch.isinf(logits[1]).sum() == MODEL_VOCAB - len(allowed)
    assert int(logits[1].argmax()) in allowed


def test_threaded_batch_fill_matches_per_matcher_fill(tokenizer) -> None:
    threaded = GrammarManager.from_tokenizer(
        tokenizer, vocab_size=MODEL_VOCAB, config=GrammarConfig(fill_threads=2)
    )
    try:
        specs = [StructuredOutputs(json=JSON_SCHEMAS["nested"]), StructuredOutputs(regex=REGEXES[1])]
        prefixes = ['{"name": "B', "dogs and ca"]
        matchers = []
        for spec, prefix in zip(specs, prefixes, strict=True):
            matcher = threaded.compile(spec).new_matcher()
            assert all(matcher.accept_token(t) for t in tokenizer.encode(prefix, add_special_tokens=False))
            matchers.append(matcher)
        done = threaded.compile(StructuredOutputs(choice=["x"])).new_matcher()
        assert done.accept_token(tokenizer.encode("x")[0]) and done.accept_token(tokenizer.eos_token_id)
        rows = [matchers[0], None, done, matchers[1]]
        batched = threaded.allocate_bitmask(4)
        batched.zero_()
        threaded.fill_bitmask(batched, rows)
        single = threaded.allocate_bitmask(4)
        for row, matcher in enumerate(rows):
            if matcher is not None:
                matcher.fill_bitmask(single, row)
        assert torch.equal(batched, single)
        assert list(allowed_ids(batched, 2)) == [tokenizer.eos_token_id]
    finally:
        threaded.shutdown()


def test_fill_bitmask_rejects_short_bitmask(manager: GrammarManager) -> None:
    matcher = manager.compile(StructuredOutputs(regex="a")).new_matcher()
    with pytest.raises(ValueError, match="fewer rows"):
        manager.fill_bitmask(manager.allocate_bitmask(1), [matcher, matcher])


def test_rollback_restores_state(manager: GrammarManager, tokenizer) -> None:
    schema = JSON_SCHEMAS["nested"]
    matcher = manager.compile(StructuredOutputs(json=schema)).new_matcher()
    text = '{"name": "Bo", "address": {"city": "Paris", "zip": 75}}'
    ids = tokenizer.encode(text, add_special_tokens=False)
    bitmask = manager.allocate_bitmask(1)
    snapshots = []
    for token in ids:
        matcher.fill_bitmask(bitmask, 0)
        snapshots.append(bitmask.clone())
        assert matcher.accept_token(token)
    assert matcher.accept_token(tokenizer.eos_token_id)
    assert matcher.is_terminated()
    assert matcher.num_accepted_tokens == len(ids) + 1
    matcher.rollback(1)
    assert not matcher.is_terminated()
    for back in (3, 5, len(ids) - 8):
        matcher.rollback(back)
        n = matcher.num_accepted_tokens
        matcher.fill_bitmask(bitmask, 0)
        assert torch.equal(bitmask, snapshots[n])
        assert all(matcher.accept_token(t) for t in ids[n:])
        matcher.rollback(len(ids) - n)
        assert matcher.num_accepted_tokens == n
        assert all(matcher.accept_token(t) for t in ids[n:])
    with pytest.raises(ValueError, match="cannot roll back"):
        matcher.rollback(len(ids) + 1)
    with pytest.raises(ValueError, match="cannot roll back"):
        matcher.rollback(-1)
    matcher.reset()
    assert matcher.num_accepted_tokens == 0
    matcher.fill_bitmask(bitmask, 0)
    assert torch.equal(bitmask, snapshots[0])


# ---- jump-forward ------------------------------------------------------------------------------------

LONG_KEYS = {
    "type": "object",
    "properties": {
        "customer_identifier": {"type": "integer"},
        "shipping_address_line": {"type": "string", "maxLength": 6},
        "is_priority_delivery": {"type": "boolean"},
    },
    "required": ["customer_identifier", "shipping_address_line", "is_priority_delivery"],
}


def test_jump_forward_produces_the_forced_keys(manager: GrammarManager, tokenizer) -> None:
    """Walk randomly, jumping whenever the grammar forces text; the output must contain the keys, be
    accepted token by token by a fresh matcher, and validate."""
    compiled = manager.compile(StructuredOutputs(json=LONG_KEYS))
    bitmask = manager.allocate_bitmask(1)
    eos = tokenizer.eos_token_id
    for seed in range(3):
        rng = random.Random(seed)
        matcher = compiled.new_matcher()
        output: list[int] = []
        jumped: list[str] = []
        for _ in range(300):
            forced = matcher.jump_forward_string()
            before = matcher.num_accepted_tokens
            tokens = manager.jump_forward(matcher, output)
            assert matcher.num_accepted_tokens == before + len(tokens)
            if tokens:
                text = text_of(manager, tokens)
                assert forced.startswith(text)
                # All of the forced text is jumped except at most the final token, held back.
                rest = forced[len(text) :]
                assert rest == "" or len(tokenizer.encode(rest, add_special_tokens=False)) == 1
                jumped.append(text)
                output += tokens
            matcher.fill_bitmask(bitmask, 0)
            allowed = allowed_ids(bitmask)
            token = int(rng.choice(list(allowed)))
            assert matcher.accept_token(token)
            if token == eos:
                break
            output.append(token)
        assert matcher.is_terminated()
        text = text_of(manager, output)
        value = json.loads(text)
        jsonschema.validate(value, LONG_KEYS)
        joined = "".join(jumped)
        for key in LONG_KEYS["properties"]:
            assert key in joined, (key, jumped)
        replay = compiled.new_matcher()
        assert all(replay.accept_token(t) for t in output)


def test_jump_forward_matches_tokenizer_and_holds_back_open_tail(manager: GrammarManager, tokenizer) -> None:
    compiled = manager.compile(StructuredOutputs(json=LONG_KEYS))
    matcher = compiled.new_matcher()
    start = tokenizer.encode('{"', add_special_tokens=False)
    assert len(start) == 1  # the test vocabulary writes '{"' as one token
    assert matcher.accept_token(start[0])
    assert matcher.jump_forward_string() == 'customer_identifier"'
    tokens = manager.jump_forward(matcher, start)
    # '"' is held back: the grammar also allows '":' here, which normal decoding may pick.
    assert tokens == tokenizer.encode("customer_identifier", add_special_tokens=False)
    assert b'":' in manager.backend.token_bytes
    assert matcher.jump_forward_string() == '"'


def test_jump_forward_backs_off_when_tokens_would_merge(tokenizer) -> None:
    mgr = GrammarManager.from_tokenizer(
        tokenizer, vocab_size=MODEL_VOCAB, config=GrammarConfig(any_whitespace=False)
    )
    try:
        matcher = mgr.compile(StructuredOutputs(json=LONG_KEYS)).new_matcher()
        assert matcher.jump_forward_string() == '{"customer_identifier": '
        brace = tokenizer.encode("{", add_special_tokens=False)
        assert matcher.accept_token(brace[0])
        # '{' + '"customer...' retokenizes as '{"' 'customer...': it would rewrite the generated '{'.
        assert tokenizer.encode('{"', add_special_tokens=False) != brace + tokenizer.encode('"')
        assert mgr.jump_forward(matcher, brace) == []
        assert matcher.num_accepted_tokens == 1
        quote = tokenizer.encode('"', add_special_tokens=False)
        assert matcher.accept_token(quote[0])
        output = brace + quote
        forced = matcher.jump_forward_string()
        assert forced == 'customer_identifier": '
        tokens = mgr.jump_forward(matcher, output)
        text = text_of(mgr, tokens)
        assert text in (forced, forced[:-1])  # the final ' ' may be held back for ' 1'-like tokens
        assert tokens == tokenizer.encode(text, add_special_tokens=False)
        # Jumping from the start: the forced text is tokenized as the tokenizer would.
        fresh = mgr.compile(StructuredOutputs(json=LONG_KEYS)).new_matcher()
        first = mgr.jump_forward(fresh, [], max_tokens=2)
        assert first == tokenizer.encode('{"customer_identifier": ', add_special_tokens=False)[:2]
        assert fresh.num_accepted_tokens == 2
        assert mgr.jump_forward(fresh, first, max_tokens=0) == []
    finally:
        mgr.shutdown()


def test_jump_forward_nothing_forced(manager: GrammarManager, tokenizer) -> None:
    matcher = manager.compile(StructuredOutputs(choice=["alpha", "beta"])).new_matcher()
    assert manager.jump_forward(matcher, []) == []
    b = tokenizer.encode("b", add_special_tokens=False)
    assert matcher.accept_token(b[0])
    tokens = manager.jump_forward(matcher, b)
    assert text_of(manager, b + tokens) == "beta"
    assert matcher.jump_forward_string() == ""


def test_jump_forward_multibyte_context(manager: GrammarManager, tokenizer) -> None:
    """A generated character split over several byte tokens is retokenized whole with the forced text."""
    matcher = manager.compile(StructuredOutputs(regex="é+-done")).new_matcher()
    e_acute = tokenizer.encode("é", add_special_tokens=False)
    assert len(e_acute) == 2  # two byte tokens in this vocabulary
    assert all(matcher.accept_token(t) for t in e_acute)
    dash = tokenizer.encode("-", add_special_tokens=False)
    assert matcher.accept_token(dash[0])
    output = e_acute + dash
    tokens = manager.jump_forward(matcher, output)
    assert text_of(manager, output + tokens) == "é-done"
    assert matcher.accept_token(tokenizer.eos_token_id)


# ---- masking cost (slow; prints timings, asserts only correctness) --------------------------------------


def _byte_level_chars() -> dict[int, str]:
    """GPT-2's byte → printable character table used by byte-level BPE vocabularies."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def build_synthetic_tokenizer(vocab_size: int, seed: int = 0) -> PreTrainedTokenizerFast:
    """A byte-level BPE with ``vocab_size`` tokens made by growing random words one merge at a time:
    cheap to build at real-model sizes (32k, 152k), unlike training one."""
    rng = random.Random(seed)
    chars = _byte_level_chars()
    vocab = {EOS: 0} | {chars[b]: b + 1 for b in range(256)}
    merges: list[tuple[str, str]] = []
    alphabet = string.ascii_lowercase * 4 + string.ascii_uppercase + string.digits + '"{}[]:,._-'
    growable = [chars[ord(c)] for c in string.ascii_letters + string.digits + '"{}[]:,']
    for c in string.ascii_lowercase:
        merges.append((chars[32], chars[ord(c)]))
        vocab[chars[32] + chars[ord(c)]] = len(vocab)
        growable.append(chars[32] + chars[ord(c)])
    while len(vocab) < vocab_size:
        base = rng.choice(growable)
        token = base + chars[ord(rng.choice(alphabet))]
        if token in vocab:
            continue
        vocab[token] = len(vocab)
        merges.append((base, token[-1]))
        if len(token) < 12:
            growable.append(token)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)


_TIMING_MIXES = {
    "json schemas": [StructuredOutputs(json=JSON_SCHEMAS[n]) for n in ("nested", "numbers", "array_enum")],
    "json_object": [StructuredOutputs(json_object=True)],
    "regex [a-z]{1,8}@...": [StructuredOutputs(regex=REGEXES[2])],
}


@pytest.mark.slow
@pytest.mark.parametrize("vocab_size", [32_000, 152_000])
def test_fill_bitmask_timing_batch_64(vocab_size: int) -> None:
    tokenizer = build_synthetic_tokenizer(vocab_size)
    mgr = GrammarManager.from_tokenizer(tokenizer, vocab_size=vocab_size + 64)
    try:
        for mix, specs in _TIMING_MIXES.items():
            compiled = [mgr.compile(spec) for spec in specs]
            matchers = [compiled[i % len(compiled)].new_matcher() for i in range(64)]
            bitmask = mgr.allocate_bitmask(64)
            rng = np.random.default_rng(0)
            fills = []
            for _ in range(50):
                start = time.perf_counter()
                mgr.fill_bitmask(bitmask, matchers)
                fills.append(time.perf_counter() - start)
                for row, matcher in enumerate(matchers):
                    token = int(rng.choice(allowed_ids(bitmask, row)))
                    assert matcher.accept_token(token)
                    if matcher.is_terminated():
                        matcher.reset()
            fills_ms = sorted(f * 1e3 for f in fills[1:])
            print(
                f"\nfill_bitmask batch=64 V={vocab_size + 64} {mix}: median {fills_ms[len(fills_ms) // 2]:.2f} ms,"
                f" p90 {fills_ms[int(0.9 * len(fills_ms))]:.2f} ms, max {fills_ms[-1]:.2f} ms"
            )
    finally:
        mgr.shutdown()
