"""Tool-call parsers on model outputs written in each family's format: content and calls, split at
every character boundary (streamed deltas must add up to the same reply as the whole text), read as
held blocks (no grammar) and as canonical ones (grammar-constrained tools), parallel calls, text
around calls, malformed JSON and unknown names (content, never a crash)."""

from __future__ import annotations

import json
import random

import pytest

from pagoda.entrypoints.openai.chat_reply import ChoiceParser, HiddenText
from pagoda.entrypoints.openai.reasoning import ReasoningParser
from pagoda.entrypoints.openai.tool_parsers import TOOL_PARSERS, ParserConfig, detect_tool_format, merge_calls
from pagoda.entrypoints.openai.tool_parsers.mistral import (
    ARGS_SYNTAX,
    LIST_SYNTAX,
    NAME_SYNTAX,
    nine_char_id,
    prepare_messages,
    syntax_from_rendering,
)

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}
TOOLS = {"get_weather": WEATHER, "get_time": None, "get": None}
ALL = frozenset(TOOLS)


def _parse(fmt: str, pieces: list[str], constrained: frozenset[str] = frozenset(), syntax=None):
    """(content, [(name, arguments)], deltas) of feeding ``pieces`` to a fresh parser."""
    tool_format = TOOL_PARSERS[fmt]
    parser = tool_format.parser(
        syntax or tool_format.syntax, ParserConfig(TOOLS, constrained), tool_format.new_id
    )
    content, deltas = "", []
    for piece in [*pieces, None]:
        out = parser.feed(piece) if piece is not None else parser.finish()
        content += out.content
        deltas += out.calls
    calls = merge_calls(deltas)
    assert parser.num_calls == len(calls)
    return content, [(c.name, c.arguments) for c in calls], deltas


def _check_deltas(deltas, fmt: str) -> None:
    """OpenAI's delta form: each call's first delta has its id and name, later ones only arguments."""
    seen: set[int] = set()
    for d in deltas:
        if d.index in seen:
            assert d.id is None and d.name is None
        else:
            assert d.index == len(seen), "calls are numbered in order"
            assert d.name and d.id
            if fmt == "mistral":
                assert len(d.id) == 9 and d.id.isalnum()
            seen.add(d.index)


def _splits(text: str, seed: int = 0):
    """The text whole, split at every boundary, one character at a time, and cut at random."""
    yield [text]
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    yield list(text)
    rng = random.Random(seed)
    for _ in range(20):
        cuts = (
            sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(2, 8))))
            if len(text) > 2
            else []
        )
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def _assert_reply(fmt, text, content, calls, constrained=frozenset(), syntax=None):
    for pieces in _splits(text):
        got_content, got_calls, deltas = _parse(fmt, pieces, constrained, syntax)
        assert (got_content, got_calls) == (content, calls), pieces
        _check_deltas(deltas, fmt)


def _args(**kw) -> str:
    return json.dumps(kw)


CASES = {
    "hermes": [
        ("Just text, no call.", "Just text, no call.", []),
        (
            'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
            "Let me check.",
            [("get_weather", _args(city="Paris"))],
        ),
        (
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
            "",
            [("get_weather", _args(city="Paris", days=2)), ("get_time", "{}")],
        ),
        (
            'Before <tool_call>{"name": "get", "arguments": {"a": "}</tool_call>"}}</tool_call> after',
            "Before after",
            [("get", _args(a="}</tool_call>"))],
        ),
        (
            'Before\n<tool_call>\n{"name": "get", "arguments": {"q": "x"}}\n</tool_call>\nafter',
            "Before\nafter",
            [("get", _args(q="x"))],
        ),
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>', None, []),
        ('<tool_call>\n{"name": "unknown_fn", "arguments": {}}\n</tool_call>', None, []),
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', None, []),
        (
            '<tool_call>\n{"name": "get", "arguments": "{\\"q\\": 1}"}\n</tool_call>',
            "",
            [("get", _args(q=1))],
        ),
        ("a <tool_ca b <tool_call", "a <tool_ca b <tool_call", []),
    ],
    "llama3_json": [
        ("Just text.", "Just text.", []),
        (
            '{"name": "get_weather", "parameters": {"city": "Paris"}}',
            "",
            [("get_weather", _args(city="Paris"))],
        ),
        (
            '<|python_tag|>{"name": "get_time", "parameters": {}}; {"name": "get", "arguments": {"q": 1}}',
            "",
            [("get_time", "{}"), ("get", _args(q=1))],
        ),
        ('{"answer": 42}', '{"answer": 42}', []),
        ('{"name": "get", "parameters": {"q": 1}} and then text', " and then text", [("get", _args(q=1))]),
        ('The JSON {"name": "get", "parameters": {}} comes later', None, []),
        ('{"name": "get_weather", "parameters": {"city": "Pa', None, []),
        ('{"name": "nope", "parameters": {}}', None, []),
    ],
    "mistral": [
        ("Plain answer.", "Plain answer.", []),
        (
            'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
            '{"name": "get_time", "arguments": {}}]',
            "Sure.",
            [("get_weather", _args(city="Paris")), ("get_time", "{}")],
        ),
        (
            '[TOOL_CALLS]get_weather{"city": "Paris"}[TOOL_CALLS]get_time{}',
            "",
            [("get_weather", _args(city="Paris")), ("get_time", "{}")],
        ),
        (
            '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get[CALL_ID]a1b2c3d4e[ARGS]{"q": 2}',
            "",
            [("get_weather", _args(city="Paris")), ("get", _args(q=2))],
        ),
        ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}]', None, []),
        ("[TOOL_CALLS]nope{}", None, []),
        ("[TOOL_CALLS] []", None, []),
        ("[TOOL_CALLS]", None, []),
    ],
    "qwen3_xml": [
        ("No call here.", "No call here.", []),
        (
            "I'll look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis, France\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
            "I'll look.",
            [("get_weather", _args(city="Paris, France", days=3))],
        ),
        (
            "<tool_call>\n<function=get_time>\n</function>\n</tool_call>\n<tool_call>\n<function=get>\n"
            '<parameter=q>\n{"a": [1, 2]}\n</parameter>\n<parameter=s>\nhello\n</parameter>\n</function>\n</tool_call>',
            "",
            [("get_time", "{}"), ("get", _args(q={"a": [1, 2]}, s="hello"))],
        ),
        ("<tool_call>\n<function=nope>\n</function>\n</tool_call>", None, []),
        ("<tool_call>\n<function=get_weather>\n<parameter=city>\nPar", None, []),
        ("<tool_call>\n<function=get>\ngarbage\n</function>\n</tool_call>", None, []),
    ],
}


@pytest.mark.parametrize(("fmt", "case"), [(f, i) for f, cases in CASES.items() for i in range(len(cases))])
def test_held_calls_every_split(fmt: str, case: int) -> None:
    text, content, calls = CASES[fmt][case]
    _assert_reply(fmt, text, text if content is None else content, calls)


# Outputs as the grammar writes them (CallSyntax), read as canonical blocks: calls stream as they come.
CANONICAL = {
    "hermes": (
        'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get", "arguments": {"q": "}\\n</tool_call>"}}\n</tool_call>',
        "Checking.",
        [("get_weather", _args(city="Paris", days=2)), ("get", _args(q="}\n</tool_call>"))],
    ),
    "llama3_json": (
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get", "parameters": {"q": [1]}}',
        "",
        [("get_weather", _args(city="Paris")), ("get", _args(q=[1]))],
    ),
    "mistral": (
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get", "arguments": {}}]',
        "",
        [("get_weather", _args(city="Paris")), ("get", "{}")],
    ),
    "qwen3_xml": (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n 4 \n"
        "</parameter>\n</function>\n</tool_call>",
        "",
        [("get_weather", _args(city="Paris", days=4))],
    ),
}


@pytest.mark.parametrize(
    ("fmt", "constrained"),
    # A marker syntax (Mistral's) constrains every call after the marker or none.
    [(f, c) for f in sorted(CANONICAL) for c in ("all", "one") if not (f == "mistral" and c == "one")],
)
def test_canonical_calls_stream_and_match_held(fmt: str, constrained: str) -> None:
    text, content, calls = CANONICAL[fmt]
    names = ALL if constrained == "all" else frozenset(["get_weather"])
    _assert_reply(fmt, text, content, calls, names)
    _assert_reply(fmt, text, content, calls)  # the same reply read without a grammar


def test_canonical_arguments_stream_in_fragments() -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
    _, calls, deltas = _parse("hermes", list(text), ALL)
    fragments = [d.arguments for d in deltas]
    assert deltas[0].name == "get_weather" and deltas[0].arguments == ""
    assert len([f for f in fragments if f]) > 10 and "".join(fragments) == calls[0][1]
    # Cut off mid-arguments (max_tokens): a constrained call stays a call, with what was written.
    content, calls, _ = _parse("hermes", [text[: text.index("Par") + 3]], ALL)
    assert content == "" and calls == [("get_weather", '{"city": "Par')]


def test_mistral_v11_canonical_and_name_form() -> None:
    text = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get[ARGS]{}'
    calls = [("get_weather", _args(city="Paris")), ("get", "{}")]
    _assert_reply("mistral", text, "", calls, ALL, ARGS_SYNTAX)
    text = '[TOOL_CALLS]get_weather{"city": "Paris"}[TOOL_CALLS]get{}'
    _assert_reply("mistral", text, "", calls, ALL, NAME_SYNTAX)


def test_mistral_syntax_and_ids() -> None:
    assert syntax_from_rendering('[TOOL_CALLS] [{"name": "probe_fn"') == LIST_SYNTAX
    assert syntax_from_rendering('[TOOL_CALLS][{"name": "probe_fn"').open == "[TOOL_CALLS]["
    assert syntax_from_rendering('[TOOL_CALLS]probe_fn[ARGS]{"k": 1}') == ARGS_SYNTAX
    assert syntax_from_rendering('[TOOL_CALLS]probe_fn{"k": 1}') == NAME_SYNTAX
    assert nine_char_id("abcDEF123") == "abcDEF123"
    mapped = nine_char_id("call_0123456789abcdef")
    assert len(mapped) == 9 and mapped.isalnum() and mapped == nine_char_id("call_0123456789abcdef")
    history = [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_x", "function": {"name": "f"}}]},
        {"role": "tool", "tool_call_id": "call_x", "content": "1"},
    ]
    out = prepare_messages(history)
    assert out[0]["tool_calls"][0]["id"] == out[1]["tool_call_id"] == nine_char_id("call_x")
    assert history[1]["tool_call_id"] == "call_x"  # the caller's messages are left alone


def test_detect_tool_format() -> None:
    assert detect_tool_format("{{ '<tool_call>' }}<function=x><parameter=y>") == "qwen3_xml"
    assert detect_tool_format("<tool_call>\n{{ tool_call | tojson }}") == "hermes"
    assert detect_tool_format("[TOOL_CALLS]") == "mistral"
    assert detect_tool_format("<|python_tag|>") == "llama3_json"
    assert detect_tool_format('<|start_header_id|> {"name": ..., "parameters": ...}') == "llama3_json"
    assert detect_tool_format("<|im_start|>{{ m.content }}") is None


# ---- reasoning and the whole reply pipeline ------------------------------------------------------------
@pytest.mark.parametrize(
    ("parser", "state", "text", "reasoning", "content"),
    [
        ("qwen3", "none", "<think>\nHmm.\n</think>\n\nAnswer.", "\nHmm.\n", "Answer."),
        ("qwen3", "none", "Direct answer <think>x</think>", "", "Direct answer <think>x</think>"),
        ("qwen3", "none", "\n<think>a</think>b", "a", "b"),
        ("qwen3", "inside", "Hmm.</think>Answer.", "Hmm.", "Answer."),
        ("qwen3", "inside", "never closed <thin", "never closed <thin", ""),
        ("qwen3", "closed", "<think>x</think>y", "", "<think>x</think>y"),
        ("deepseek_r1", "none", "Thinking</think>\n\nDone", "Thinking", "Done"),
        ("deepseek_r1", "none", "<think>Thinking</think>Done", "Thinking", "Done"),
        ("deepseek_r1", "inside", "all thought", "all thought", ""),
    ],
)
def test_reasoning_every_split(parser: str, state: str, text: str, reasoning: str, content: str) -> None:
    for pieces in _splits(text):
        p = ReasoningParser(parser, state)
        got = [p.feed(piece) for piece in pieces] + [p.finish()]
        assert ("".join(r for r, _ in got), "".join(c for _, c in got)) == (reasoning, content), pieces


def test_hidden_text_every_split() -> None:
    hidden = ("<|eot_id|>", "<|start_header_id|>", "</s>")
    text = "a<|eot_id|>b</s><|start_he c</s"
    for pieces in _splits(text):
        h = HiddenText(hidden)
        assert "".join(h.feed(p) for p in pieces) + h.feed("", final=True) == "ab<|start_he c</s"


def test_choice_pipeline_reasoning_then_calls() -> None:
    fmt = TOOL_PARSERS["mistral"]
    text = '<think>plan</think>\n\nOK[/INST] [TOOL_CALLS] [{"name": "get_time", "arguments": {}}]</s>'
    for pieces in _splits(text):
        parser = ChoiceParser(
            HiddenText(("[/INST]", "</s>")),
            ReasoningParser("qwen3", "none"),
            fmt.new_parser(ParserConfig(TOOLS, ALL)),
        )
        deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
        assert "".join(d.reasoning for d in deltas) == "plan"
        assert "".join(d.content for d in deltas) == "OK"
        calls = merge_calls([c for d in deltas for c in d.calls])
        assert [(c.name, c.arguments) for c in calls] == [("get_time", "{}")]
