"""The messages between the engine core and its front ends, and the one output builder over them."""

from __future__ import annotations

import pickle

import pytest
from transformers import AutoTokenizer

from pagoda.engine.messages import (
    EngineCoreOutput,
    EngineCoreRequest,
    EngineStats,
    RequestStepStats,
    StepStats,
)
from pagoda.engine.output_processor import OutputProcessor, RequestGroup, _Completion
from pagoda.outputs import Logprob
from pagoda.sampling_params import SamplingParams
from pagoda.tokenizer import OutputTextState


def test_messages_are_plain_picklable_data() -> None:
    """What a core in another process would send and receive (the grammar handle aside)."""
    req = EngineCoreRequest(
        "r-1", [1, 2, 3], SamplingParams(max_tokens=4), 4, frozenset({2}), 0.5, cache_salt="s", fork_of="r-0"
    )
    out = EngineCoreOutput("r-1", [5, 6], [{5: Logprob(-0.1, 1)}, {6: Logprob(-0.2, 1)}], "stop", 6, 3)
    stats = StepStats(EngineStats(num_running=1, kv_usage=0.25), [RequestStepStats("r", 3, 2, ttft=0.1)])
    for msg in (req, out, stats):
        assert pickle.loads(pickle.dumps(msg)) == msg
    assert out.finished and not EngineCoreOutput("r", [1]).finished
    assert EngineStats(num_running=2, num_waiting=3).num_unfinished == 5
    with pytest.raises(AttributeError):
        req.max_tokens = 5  # frozen


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: str):
    return AutoTokenizer.from_pretrained(tiny_llama_dir)


def _group(tokenizer, rid: str, stream: bool, params: SamplingParams) -> RequestGroup:
    prompt = [1, 5, 6]
    completions = [
        _Completion(i, OutputTextState.from_sampling_params(tokenizer, prompt, params)) for i in range(2)
    ]
    return RequestGroup(rid, None, prompt, completions, [f"{rid}-0", f"{rid}-1"], stream)


def test_one_builder_gives_deltas_or_one_cumulative_output(tokenizer) -> None:
    """A non-streamed request's single output is what folding its streamed deltas gives (this
    replaces AsyncLLM's second accumulation of outputs)."""
    params = SamplingParams(max_tokens=8)
    proc = OutputProcessor(tokenizer)
    proc.add(_group(tokenizer, "s", True, params))
    proc.add(_group(tokenizer, "w", False, params))
    steps = [
        [("0", [40, 41], None), ("1", [50], None)],
        [("1", [51], "length")],
        [("0", [42], "stop")],
    ]
    deltas = []
    finals = []
    for step in steps:
        msgs = []
        for rid in ("s", "w"):
            for child, ids, reason in step:
                stop_reason = ids[-1] if reason == "stop" else None
                msgs.append(EngineCoreOutput(f"{rid}-{child}", ids, None, reason, stop_reason, 2))
        assert proc.process(msgs) == {}
        outputs, stats = proc.take_outputs()
        deltas += [o for o in outputs if o.request_id == "s"]
        finals += [o for o in outputs if o.request_id == "w"]
        assert {s.request_id for s in stats} == {"s", "w"}
    assert len(finals) == 1 and finals[0].finished and len(deltas) == 3
    folded: dict[int, list] = {}
    for d in deltas:
        for c in d.outputs:
            text, ids, reason = folded.get(c.index, ["", [], None])
            folded[c.index] = [text + c.text, ids + c.token_ids, c.finish_reason or reason]
    whole = {c.index: [c.text, c.token_ids, c.finish_reason] for c in finals[0].outputs}
    assert whole == folded
    assert whole[0][1:] == [[40, 41, 42], "stop"] and whole[1][1:] == [[50, 51], "length"]
    assert finals[0].num_cached_tokens == 2
    assert not proc.groups and not proc.knows("s-0")  # forgotten once finished, in one place


def test_a_stop_string_goes_back_to_the_core_and_its_abort_finishes_it(tokenizer) -> None:
    text = "hello world, and more"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    params = SamplingParams(max_tokens=50, stop=["world"])
    proc = OutputProcessor(tokenizer)
    group = _group(tokenizer, "r", True, params)
    group.completions.pop()
    group.child_ids.pop()
    proc.add(group)
    stopped = proc.process([EngineCoreOutput("r-0", ids)])
    assert stopped == {"r-0": "world"}
    outputs, _ = proc.take_outputs()
    assert outputs[0].outputs[0].finish_reason is None  # not finished until the core says so
    # The core's abort with reason "stop" is the one record of how it finished.
    proc.process([EngineCoreOutput("r-0", [], None, "stop", "world")])
    outputs, stats = proc.take_outputs()
    (c,) = outputs[0].outputs
    assert outputs[0].finished and (c.finish_reason, c.stop_reason) == ("stop", "world")
    assert stats[0].finish_reasons == ("stop",) and stats[0].e2e is not None


def test_an_error_finish_carries_its_message(tokenizer) -> None:
    params = SamplingParams(max_tokens=8)
    proc = OutputProcessor(tokenizer)
    proc.add(_group(tokenizer, "r", False, params))
    proc.process(
        [
            EngineCoreOutput("r-0", [40], None, "length"),
            EngineCoreOutput("r-1", [], None, "error", error="bad token"),
        ]
    )
    (out,), _ = proc.take_outputs()
    assert [(c.finish_reason, c.error) for c in out.outputs] == [("length", None), ("error", "bad token")]
