"""Grammars only ever allow valid UTF-8."""

from __future__ import annotations

import codecs
import json
import random

import jsonschema
import pytest
import xgrammar as xgr
from grammar_helpers import (
    MODEL_VOCAB,
    allowed_ids,
    valid_utf8_prefix,
)

from pagoda.sampling_params import StructuredOutputs
from pagoda.structured import GrammarManager
from pagoda.structured.valid_utf8 import valid_utf8_ebnf, valid_utf8_grammar
from pagoda.structured.xgrammar_backend import _json_schema_grammar

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
