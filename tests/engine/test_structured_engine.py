"""Structured output through the whole engine, on a tiny random model (it knows nothing of JSON)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pagoda import LLM, SamplingParams, StructuredOutputs

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "customer_name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "member": {"type": "boolean"},
        },
        "required": ["customer_name", "age", "member"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "order": {
                "type": "object",
                "properties": {
                    "id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
                    "items": {"type": "array", "items": {"enum": ["tea", "coffee", "cake"]}, "maxItems": 3},
                    "total": {"type": "number"},
                },
                "required": ["id", "items"],
                "additionalProperties": False,
            },
            "note": {"type": "string", "maxLength": 8},
        },
        "required": ["order"],
        "additionalProperties": False,
    },
    {
        "type": "array",
        "items": {"type": "integer", "minimum": -5, "maximum": 5},
        "minItems": 1,
        "maxItems": 4,
    },
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
]


@pytest.fixture(scope="module")
def llm(tiny_model_dirs):
    return LLM(tiny_model_dirs["LlamaForCausalLM"], dtype="float32", num_kv_blocks=1024, block_size=8)


def _clean(llm: LLM) -> None:
    assert not llm.engine.has_unfinished_requests()
    llm.engine.core.check_invariants()


def test_json_schemas_always_validate(llm):
    params = [
        SamplingParams(
            temperature=1.0,
            seed=i,
            max_tokens=400,
            n=1 + i % 2,
            structured_outputs=StructuredOutputs(json=SCHEMAS[i % len(SCHEMAS)]),
        )
        for i in range(96)
    ]
    outs = llm.generate([f"request {i}:" for i in range(len(params))], params)
    checked = 0
    for i, out in enumerate(outs):
        for comp in out.outputs:
            assert comp.finish_reason == "stop", comp.text  # the grammar ended before max_tokens
            jsonschema.validate(json.loads(comp.text), SCHEMAS[i % len(SCHEMAS)])
            checked += 1
    assert checked == 144
    _clean(llm)


def test_regex_choice_grammar_and_json_object(llm):
    regex = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"
    choices = ["yes", "no", "maybe so"]
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    cases = [
        (StructuredOutputs(regex=regex), lambda t: re.fullmatch(regex, t)),
        (StructuredOutputs(choice=choices), lambda t: t in choices),
        (StructuredOutputs(grammar=grammar), lambda t: re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", t)),
    ]
    for spec, ok in cases:
        outs = llm.generate(
            [f"q{i}" for i in range(16)],
            [
                SamplingParams(temperature=1.0, seed=i, max_tokens=300, structured_outputs=spec)
                for i in range(16)
            ],
        )
        for out in outs:
            text = out.outputs[0].text
            assert out.outputs[0].finish_reason == "stop", (spec.kind, text)
            assert ok(text), (spec.kind, text)
    # Free-form JSON may wander in a string until max_tokens; what ends is an object.
    outs = llm.generate(
        [f"q{i}" for i in range(16)],
        [
            SamplingParams(
                temperature=1.0, seed=i, max_tokens=60, structured_outputs=StructuredOutputs(json_object=True)
            )
            for i in range(16)
        ],
    )
    for out in outs:
        text = out.outputs[0].text
        assert text.startswith("{")
        if out.outputs[0].finish_reason == "stop":
            assert isinstance(json.loads(text), dict)
    _clean(llm)


def test_invalid_specs_are_clear_errors(llm):
    with pytest.raises(ValueError, match="regex"):
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputs(regex="[a-")))
    with pytest.raises(ValueError):
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputs(json={"type": "nonsense"})))
    with pytest.raises(ValueError, match="min_tokens"):
        llm.generate("x", SamplingParams(min_tokens=2, structured_outputs=StructuredOutputs(choice=["a"])))
    _clean(llm)


@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "LlamaForCausalLM"])
def test_jump_forward_keeps_outputs_and_saves_steps(tiny_model_dirs, arch):
    """Drafts are verified by sampling at each position, so outputs are identical with
    jump-forward on and off: greedy, and seeded sampling too."""
    schema = {
        "type": "object",
        "properties": {
            "customer_full_name": {"type": "string", "maxLength": 6},
            "customer_membership_level": {"enum": ["gold", "silver"]},
            "customer_is_active": {"type": "boolean"},
        },
        "required": ["customer_full_name", "customer_membership_level", "customer_is_active"],
        "additionalProperties": False,
    }
    spec = StructuredOutputs(json=schema)
    params = [SamplingParams(temperature=0, max_tokens=300, structured_outputs=spec)] * 4 + [
        SamplingParams(temperature=1.0, seed=i, max_tokens=300, structured_outputs=spec, n=2)
        for i in range(4)
    ]
    results, steps = {}, {}
    for jf in (True, False):
        llm = LLM(
            tiny_model_dirs[arch],
            dtype="float32",
            num_kv_blocks=512,
            enable_jump_forward=jf,
            jump_forward_max_running=64,
        )
        outs = llm.generate([f"p{i}" for i in range(len(params))], params)
        results[jf] = [[(c.text, c.token_ids) for c in o.outputs] for o in outs]
        core = llm.engine.core
        steps[jf] = core.scheduler.stats.num_steps
        if jf:
            assert core.drafter.stats.num_jump_forward_accepted > 0
        else:
            assert core.drafter.stats.num_jump_forward_tokens == 0
        _clean(llm)
    assert results[True] == results[False]
    assert steps[True] < steps[False]
    for completions in results[True]:
        for text, _ in completions:
            jsonschema.validate(json.loads(text), schema)


def test_jump_forward_waits_for_a_small_batch(tiny_model_dirs):
    """Beyond jump_forward_max_running running requests no drafts are proposed; outputs do not
    change, and drafts resume once few requests are left."""
    schema = {
        "type": "object",
        "properties": {
            "customer_membership_level": {"enum": ["gold", "silver"]},
            "customer_is_active": {"type": "boolean"},
        },
        "required": ["customer_membership_level", "customer_is_active"],
        "additionalProperties": False,
    }
    structured = SamplingParams(
        temperature=0, max_tokens=200, structured_outputs=StructuredOutputs(json=schema)
    )
    params = [structured, structured, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)]
    prompts = ["first", "second", "third"]
    model = tiny_model_dirs["LlamaForCausalLM"]
    llm = LLM(model, dtype="float32", num_kv_blocks=256, jump_forward_max_running=2)
    core = llm.engine.core
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        llm.engine.add_request(f"r{i}", prompt, p)
    proposed_while_crowded = 0
    outputs = {}
    while llm.engine.has_unfinished_requests():
        crowded = len(core.scheduler.running) > 2
        before = core.drafter.stats.num_jump_forward_tokens
        for out in llm.engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        if crowded or len(core.scheduler.running) > 2:  # more than 2 running when drafts were due
            proposed_while_crowded += core.drafter.stats.num_jump_forward_tokens - before
    assert proposed_while_crowded == 0
    assert core.drafter.stats.num_jump_forward_tokens > 0  # after the third request finished
    reference = LLM(model, dtype="float32", num_kv_blocks=256, enable_jump_forward=False)
    expected = reference.generate(prompts, params)
    assert [outputs[f"r{i}"] for i in range(3)] == [o.outputs[0].token_ids for o in expected]
    _clean(llm)
    _clean(reference)
    with pytest.raises(ValueError, match="jump_forward_max_running"):
        LLM(model, dtype="float32", jump_forward_max_running=0)


def test_preemption_and_chunked_prefill_keep_structured_outputs(tiny_model_dirs):
    """A pool so small that requests are preempted (drafts dropped, grammar rolled back) and a
    token budget that chunks prompts: the outputs equal those of a roomy engine."""
    spec = StructuredOutputs(json=SCHEMAS[0])
    prompts = [f"a longer prompt that spans several blocks, number {i}" for i in range(8)]
    params = [
        SamplingParams(temperature=0.9, seed=i, max_tokens=200, structured_outputs=spec) for i in range(8)
    ]
    results = {}
    for name, kwargs in {
        "roomy": {"num_kv_blocks": 512},
        "tight": {"num_kv_blocks": 40, "max_num_batched_tokens": 24},
    }.items():
        llm = LLM(tiny_model_dirs["LlamaForCausalLM"], dtype="float32", block_size=8, **kwargs)
        outs = llm.generate(prompts, params)
        results[name] = [o.outputs[0].token_ids for o in outs]
        if name == "tight":
            assert llm.engine.core.scheduler.stats.num_preemptions > 0
        _clean(llm)
    assert results["tight"] == results["roomy"]


@pytest.mark.parametrize("jump_forward", [False, True])
def test_a_token_its_grammar_rejects_fails_that_request_only(tiny_model_dirs, jump_forward):
    """A sampled token the grammar rejects (possible where a dead end comes from the vocabulary)
    finishes that request with finish_reason "error" and a message; the engine serves on."""
    from pagoda.structured.xgrammar_backend import XGrammarMatcher

    class RejectsThird(XGrammarMatcher):
        """Its mask allows a third token that accepting then rejects (as a vocabulary dead end)."""

        __slots__ = ()

        def accept_token(self, token_id: int) -> bool:
            return self._num_accepted != 2 and super().accept_token(token_id)

    class Wrapped:
        def __init__(self, compiled) -> None:
            self.compiled = compiled

        def new_matcher(self):
            return RejectsThird(self.compiled._compiled, self.compiled._stop_token_ids)

    llm = LLM(
        tiny_model_dirs["LlamaForCausalLM"],
        dtype="float32",
        num_kv_blocks=256,
        enable_jump_forward=jump_forward,
    )
    engine = llm.engine
    spec = StructuredOutputs(json=SCHEMAS[0])
    params = SamplingParams(temperature=0, max_tokens=80, structured_outputs=spec)
    compiled = engine.compile_grammar(spec).result()
    engine.add_request("bad", "Customer:", params, grammar=Wrapped(compiled))
    engine.add_request("good", "Customer:", params)
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    bad, good = finals["bad"].outputs[0], finals["good"].outputs[0]
    assert bad.finish_reason == "error" and "grammar" in bad.error
    assert len(bad.token_ids) == 2  # what it had before the rejected token
    assert good.finish_reason == "stop" and good.error is None
    jsonschema.validate(json.loads(good.text), SCHEMAS[0])
    _clean(llm)
    (again,) = llm.generate(["Customer:"], params)  # and it keeps serving
    assert again.outputs[0].text == good.text
