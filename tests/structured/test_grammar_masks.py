"""EOS handling, masks, rollback and jump-forward strings."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch
import xgrammar as xgr
from grammar_helpers import (
    JSON_SCHEMAS,
    MODEL_VOCAB,
    REGEXES,
    allowed_ids,
    text_of,
)

from pagoda.sampling_params import StructuredOutputs
from pagoda.structured import GrammarConfig, GrammarManager

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
