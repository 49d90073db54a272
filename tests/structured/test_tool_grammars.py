"""Structural tags for tool calls and reasoning (pagoda.structured.tags): what each tool choice lets
through, in every family's call syntax, and random walks that always end in calls the family's
parser reads back with arguments that validate against the schemas."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
from grammar_helpers import MODEL_VOCAB, allowed_ids

from pagoda.entrypoints.openai.tool_parsers import TOOL_PARSERS, ParserConfig, merge_calls
from pagoda.entrypoints.openai.tool_parsers.mistral import ARGS_SYNTAX, NAME_SYNTAX
from pagoda.sampling_params import StructuredOutputs
from pagoda.structured import GrammarConfig, GrammarManager
from pagoda.structured.spec import spec_key
from pagoda.structured.tags import (
    CallSyntax,
    ThinkSpan,
    ToolSchema,
    answer_after_thinking,
    tool_call_constraint,
)

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 5},
        "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
}
CLOCK = {"type": "object", "properties": {"tz": {"enum": ["utc", "cet"]}}, "required": ["tz"]}
TOOLS = [ToolSchema("get_weather", WEATHER, strict=True), ToolSchema("get_time", CLOCK)]
SCHEMAS = {t.name: t.parameters for t in TOOLS}
SYNTAXES = {
    "hermes": TOOL_PARSERS["hermes"].syntax,
    "llama3_json": TOOL_PARSERS["llama3_json"].syntax,
    "mistral": TOOL_PARSERS["mistral"].syntax,
    "mistral_args": ARGS_SYNTAX,
    "mistral_name": NAME_SYNTAX,
    "qwen3_xml": TOOL_PARSERS["qwen3_xml"].syntax,
}


@pytest.fixture(scope="module")
def compact(tokenizer):
    """The engine's configuration: compact JSON."""
    mgr = GrammarManager.from_tokenizer(
        tokenizer, vocab_size=MODEL_VOCAB, config=GrammarConfig(any_whitespace=False)
    )
    yield mgr
    mgr.shutdown()


def _accepts(manager: GrammarManager, tokenizer, spec: StructuredOutputs, text: str) -> bool:
    """Whether the grammar takes ``text`` and may end after it."""
    matcher = manager.compile(spec).new_matcher()
    for token in tokenizer.encode(text, add_special_tokens=False):
        if not matcher.accept_token(token):
            return False
    return matcher.accept_token(manager.backend.stop_token_ids[0])


def _call(syntax: CallSyntax, name: str, arguments: dict) -> str:
    if syntax.arguments == "xml":
        body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in arguments.items())
    else:
        body = json.dumps(arguments)
    return syntax.begin_for(name) + body + syntax.end


def _block(syntax: CallSyntax, calls: list[tuple[str, dict]]) -> str:
    return syntax.open + syntax.separator.join(_call(syntax, n, a) for n, a in calls) + syntax.close


GOOD = ("get_weather", {"city": "Paris", "unit": "c", "days": 3})
TIME = ("get_time", {"tz": "utc"})
BAD_ARGS = ("get_weather", {"city": "Paris", "unit": "kelvin", "days": 3})


@pytest.mark.parametrize("family", sorted(SYNTAXES))
def test_required_and_named(compact, tokenizer, family: str) -> None:
    syntax = SYNTAXES[family]
    required = tool_call_constraint(syntax, TOOLS, "required")
    single = tool_call_constraint(syntax, TOOLS, "required", parallel=False)
    named = tool_call_constraint(syntax, TOOLS, "named", name="get_time")

    def accepts(spec, text):
        return _accepts(compact, tokenizer, spec, text)

    assert accepts(required, _block(syntax, [GOOD]))
    assert accepts(required, _block(syntax, [GOOD, TIME]))
    assert not accepts(required, "Some text instead of a call")
    assert not accepts(required, "")
    assert not accepts(required, _block(syntax, [BAD_ARGS]))
    assert not accepts(required, _block(syntax, [("get_date", {})]))
    assert accepts(single, _block(syntax, [TIME]))
    assert not accepts(single, _block(syntax, [GOOD, TIME]))
    assert accepts(named, _block(syntax, [TIME]))
    assert not accepts(named, _block(syntax, [GOOD]))
    assert not accepts(named, _block(syntax, [TIME, TIME]))


@pytest.mark.parametrize("family", ["hermes", "llama3_json", "qwen3_xml", "mistral_args"])
def test_auto_constrains_strict_calls_only(compact, tokenizer, family: str) -> None:
    syntax = SYNTAXES[family]
    auto = tool_call_constraint(syntax, TOOLS, "auto")
    assert auto is not None

    def accepts(text):
        return _accepts(compact, tokenizer, auto, text)

    assert accepts("Free text, no call at all.")
    assert accepts("Let me check. " + _call(syntax, *GOOD) + " Done.")
    assert not accepts(_call(syntax, *BAD_ARGS))  # a strict tool: its arguments follow the schema
    assert accepts(_call(syntax, "get_time", {"tz": "anything"}))  # not strict: free
    # Nothing to constrain: no grammar at all.
    assert tool_call_constraint(syntax, [ToolSchema("get_time", CLOCK)], "auto") is None
    single = tool_call_constraint(syntax, TOOLS, "auto", parallel=False)
    assert _accepts(compact, tokenizer, single, "Hi. " + _call(syntax, *TIME))
    assert not _accepts(compact, tokenizer, single, _call(syntax, *TIME) + " more text")


@pytest.mark.parametrize("family", ["mistral", "mistral_name"])
def test_auto_with_a_marker_constrains_every_call(compact, tokenizer, family: str) -> None:
    syntax = SYNTAXES[family]
    auto = tool_call_constraint(syntax, TOOLS, "auto")
    assert _accepts(compact, tokenizer, auto, "Plain text.")
    assert _accepts(compact, tokenizer, auto, "Sure. " + _block(syntax, [GOOD, ("get_time", {"tz": "any"})]))
    assert not _accepts(compact, tokenizer, auto, _block(syntax, [BAD_ARGS]))
    assert not _accepts(compact, tokenizer, auto, "[TOOL_CALLS] not a call")


@pytest.mark.parametrize("opened", [True, False])
def test_constraints_start_after_reasoning(compact, tokenizer, opened: bool) -> None:
    think = ThinkSpan(opened=opened)
    syntax = SYNTAXES["hermes"]
    required = tool_call_constraint(syntax, TOOLS, "required", think=think)
    answer = answer_after_thinking(StructuredOutputs(json=CLOCK), think)
    thought = "Hmm, {not json} <tool_call> maybe." + "</think>\n\n"
    thought = thought if opened else "<think>" + thought
    assert _accepts(compact, tokenizer, required, thought + _block(syntax, [TIME]))
    assert not _accepts(compact, tokenizer, required, thought + "no call")
    assert _accepts(compact, tokenizer, answer, thought + '{"tz": "cet"}')
    assert not _accepts(compact, tokenizer, answer, thought + '{"tz": "pst"}')
    # Not opened: the thought is optional; opened: it must be closed first.
    assert _accepts(compact, tokenizer, answer, '{"tz": "cet"}') is not opened


def test_specs_are_canonical_and_cached(compact) -> None:
    a = tool_call_constraint(SYNTAXES["hermes"], TOOLS, "required")
    b = tool_call_constraint(SYNTAXES["hermes"], list(TOOLS), "required")
    assert a == b and spec_key(a) == spec_key(b)
    assert compact.compile(a) is compact.compile(b)
    with pytest.raises(ValueError, match="not among the tools"):
        tool_call_constraint(SYNTAXES["hermes"], TOOLS, "named", name="nope")
    with pytest.raises(ValueError, match="structural_tag is not valid JSON"):
        spec_key(StructuredOutputs(structural_tag="{"))
    with pytest.raises(ValueError, match="structural_tag"):
        compact.compile(
            StructuredOutputs(structural_tag={"type": "structural_tag", "format": {"type": "nope"}})
        )


def test_user_structural_tag(compact, tokenizer) -> None:
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "sequence",
            "elements": [
                {"type": "const_string", "value": "Answer: "},
                {"type": "json_schema", "json_schema": CLOCK},
            ],
        },
    }
    spec = StructuredOutputs(structural_tag=tag)
    assert _accepts(compact, tokenizer, spec, 'Answer: {"tz": "utc"}')
    assert not _accepts(compact, tokenizer, spec, 'Answer: {"tz":"utc"}')  # compact JSON, as configured
    assert not _accepts(compact, tokenizer, spec, 'Answer: {"tz": "x"}')


@pytest.mark.parametrize("family", ["hermes", "llama3_json", "mistral", "mistral_args", "qwen3_xml"])
def test_random_walks_end_in_valid_calls(compact, tokenizer, family: str) -> None:
    """Sampling uniformly among allowed tokens (a model that knows nothing of tools) always gives
    calls that parse, of known tools, with arguments valid for their schemas."""
    syntax = SYNTAXES[family]
    fmt = TOOL_PARSERS["mistral" if family.startswith("mistral") else family]
    tools = TOOLS if family != "qwen3_xml" else [ToolSchema("get_time", CLOCK), ToolSchema("unit", _UNIT)]
    schemas = {t.name: t.parameters for t in tools}
    spec = tool_call_constraint(syntax, tools, "required", parallel=False)
    compiled = compact.compile(spec)
    eos = compact.backend.stop_token_ids[0]
    token_bytes = compact.backend.token_bytes
    closers = {i for i, b in enumerate(token_bytes) if b and set(b.decode("latin-1")) <= set('"}]>\n')}
    bitmask = compact.allocate_bitmask(1)
    for seed in range(12):
        rng = random.Random(seed)
        matcher = compiled.new_matcher()
        ids: list[int] = []
        while not matcher.is_terminated() and len(ids) < 300:
            compact.fill_bitmask(bitmask, [matcher])
            allowed = allowed_ids(bitmask).tolist()
            preferred = [t for t in allowed if t in closers or t == eos]
            token = rng.choice(preferred if preferred and rng.random() < 0.3 else allowed)
            assert matcher.accept_token(token)
            ids.append(token)
        assert matcher.is_terminated(), f"seed {seed}: no end after {len(ids)} tokens"
        text = b"".join(token_bytes[t] for t in ids[:-1]).decode("utf-8")
        parser = fmt.parser(syntax, ParserConfig(schemas, frozenset(schemas)), fmt.new_id)
        deltas = parser.feed(text).calls + parser.finish().calls
        (call,) = merge_calls(deltas)
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])


_UNIT = {
    "type": "object",
    "properties": {"u": {"enum": ["c", "f"]}, "n": {"type": "integer"}},
    "required": ["u"],
}
