"""Grammar compile, compile cache and async compile."""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import Future

import pytest
from grammar_helpers import (
    MODEL_VOCAB,
    allowed_ids,
)

from pagoda.sampling_params import StructuredOutputs
from pagoda.structured import GrammarConfig, GrammarManager, XGrammarBackend, spec_key

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
