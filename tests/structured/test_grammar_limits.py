"""Grammar compiles with a deadline (CompilePool), specs that must never compile (references to
files or URLs, grammars that match nothing) and nesting deeper than Python's stack."""

from __future__ import annotations

import random
import string
import threading
import time
from concurrent.futures import Future

import pytest
from grammar_helpers import MODEL_VOCAB

from pagoda.sampling_params import StructuredOutputs
from pagoda.structured import GrammarConfig, GrammarManager
from pagoda.structured.compile_pool import CompilePool, GrammarBusyError, GrammarTimeoutError

WAIT_S = 30.0


def _held(release: threading.Event, value: object = "done"):
    def fn() -> object:
        if not release.wait(WAIT_S):
            raise TimeoutError("the test never released the job")
        return value

    return fn


def test_a_compile_past_its_deadline_fails_and_frees_its_worker() -> None:
    pool = CompilePool(workers=1, timeout_s=0.2, max_abandoned=2)
    stuck, release = threading.Event(), threading.Event()
    try:
        slow = pool.submit(lambda: stuck.wait(WAIT_S))
        with pytest.raises(GrammarTimeoutError, match="--grammar-compile-timeout"):
            slow.result(WAIT_S)
        assert pool.num_abandoned == 1
        # The one worker is free again although the abandoned compile still runs.
        assert pool.submit(lambda: 42).result(WAIT_S) == 42
        with pytest.raises(GrammarTimeoutError):
            pool.submit(lambda: stuck.wait(WAIT_S)).result(WAIT_S)
        # While max_abandoned compiles burn CPU, new ones are refused at once, not queued.
        assert isinstance(pool.submit(_held(release)).exception(0), GrammarBusyError)
        stuck.set()
        deadline = time.monotonic() + WAIT_S
        while pool.num_abandoned and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pool.num_abandoned == 0
        assert pool.submit(lambda: "again").result(WAIT_S) == "again"
    finally:
        stuck.set()
        release.set()
        pool.shutdown()


def test_queued_compiles_wait_for_a_worker_and_errors_pass_through() -> None:
    pool = CompilePool(workers=1, timeout_s=WAIT_S, max_abandoned=1)
    release = threading.Event()
    try:
        first = pool.submit(_held(release, 1))
        second = pool.submit(_held(release, 2))
        failing = pool.submit(lambda: 1 / 0)
        assert not second.running() and not first.done()
        release.set()
        assert (first.result(WAIT_S), second.result(WAIT_S)) == (1, 2)
        assert isinstance(failing.exception(WAIT_S), ZeroDivisionError)
        queued_after_shutdown = pool.submit(_held(threading.Event()))
        pool.shutdown()
        assert isinstance(pool.submit(lambda: 0).exception(0), RuntimeError)
        assert queued_after_shutdown.running() or queued_after_shutdown.done()
    finally:
        release.set()
        pool.shutdown()
    with pytest.raises(ValueError):
        CompilePool(workers=1, timeout_s=0, max_abandoned=1)


def test_a_real_schema_that_compiles_too_long_is_a_value_error(tokenizer) -> None:
    # Many optional properties: xgrammar's compile time grows about cubically with their number
    # (300 take about a second here; the deadline is 50 ms).
    rnd = random.Random(0)
    names = {"".join(rnd.choice(string.ascii_letters) for _ in range(8)) for _ in range(300)}
    schema = {"type": "object", "properties": {k: {"type": "string"} for k in names}, "required": []}
    config = GrammarConfig(compile_timeout_s=0.05)
    mgr = GrammarManager.from_tokenizer(tokenizer, vocab_size=MODEL_VOCAB, config=config)
    try:
        future: Future = mgr.compile_async(StructuredOutputs(json=schema))
        with pytest.raises(ValueError, match=r"took longer than 0\.05s"):
            future.result(WAIT_S)
        # Cached as failed: the same spec fails at once instead of compiling again.
        assert mgr.compile_async(StructuredOutputs(json=schema)) is future
    finally:
        mgr.shutdown()


@pytest.mark.parametrize(
    "ref", ["file:///etc/passwd", "http://127.0.0.1:9/schema.json", "other.json#/x", "/abs/path.json"]
)
def test_schema_references_outside_the_schema_are_refused(manager: GrammarManager, ref: str) -> None:
    for schema in ({"$ref": ref}, {"type": "object", "properties": {"a": {"$ref": ref}}}):
        with pytest.raises(ValueError, match="never read from files or URLs"):
            manager.compile_async(StructuredOutputs(json=schema))
    local = {
        "$defs": {"n": {"type": "integer"}},
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/n"}},
    }
    assert manager.compile_async(StructuredOutputs(json=local)).result(WAIT_S)


@pytest.mark.parametrize("grammar", ["root ::= a\na ::= root", "root ::= root"])
def test_a_grammar_that_matches_nothing_is_refused(manager: GrammarManager, grammar: str) -> None:
    # Without this check the sampler finds no allowed token at all and the engine stops.
    future = manager.compile_async(StructuredOutputs(grammar=grammar))
    with pytest.raises(ValueError, match="matches no output"):
        future.result(WAIT_S)


@pytest.mark.parametrize(
    "grammar",
    [
        'root ::= "x" a | "y"\na ::= a',
        'root ::= "x" a\na ::= b | b\nb ::= a',
        'root ::= "x" ("" a)\na ::= a "q"',
        'root ::= [a-z]+ a\na ::= b "q"\nb ::= b',
        'start: "x" a | "y"\na: a',  # Lark
    ],
)
def test_a_grammar_with_a_dead_end_is_refused(manager: GrammarManager, grammar: str) -> None:
    # After "x" no token would be allowed at all: the engine could sample nothing.
    with pytest.raises(ValueError, match="dead end"):
        manager.compile_async(StructuredOutputs(grammar=grammar)).result(WAIT_S)


@pytest.mark.parametrize(
    "grammar",
    [
        'root ::= "x" a | "y"\na ::= "x" a',  # never ends, but always allows "x"
        'root ::= a?\na ::= a "q"',  # a is a dead end but never reached: root may be empty
        'root ::= ("a" | [b-c]*)+ d{2,3} (= "q")\nd ::= "q"? [^"]*',
        'root ::= "" | "x" root',
        'root ::= [a-z]+ a*\na ::= "q" | b\nb ::= b',  # b's alternative is never entered
        'start: "a" b\nb: /[0-9]+/ | "x"',
    ],
)
def test_grammars_without_dead_ends_compile(manager: GrammarManager, grammar: str) -> None:
    assert manager.compile_async(StructuredOutputs(grammar=grammar)).result(WAIT_S)


def test_nesting_past_the_python_stack_is_a_value_error(manager: GrammarManager) -> None:
    deep: dict = {"type": "integer"}
    for _ in range(2000):
        deep = {"type": "array", "items": deep}
    with pytest.raises(ValueError, match="nested too deeply"):
        manager.compile_async(StructuredOutputs(json=deep))
    pattern = {"type": "string", "pattern": "(" * 2000 + "a" + ")" * 2000}
    with pytest.raises(ValueError, match="nested too deeply"):
        manager.compile_async(StructuredOutputs(json=pattern))
