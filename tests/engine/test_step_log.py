"""`step_log` (`--step-log FILE`): one JSON line per engine step whose counts add up to the
work the engine did; a bad path is a clear error before the model loads."""

from __future__ import annotations

import json
import os

import pytest

from pagoda import LLM, SamplingParams
from pagoda.config import EngineArgs


def _lines(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_step_log_counts_the_steps(tiny_model_dirs, tmp_path) -> None:
    path = tmp_path / "steps.jsonl"
    llm = LLM(
        tiny_model_dirs["LlamaForCausalLM"],
        dtype="float32",
        num_kv_blocks=128,
        block_size=4,
        max_num_batched_tokens=16,  # a 40-token prompt goes in chunks
        enable_prefix_caching=False,
        step_log=str(path),
    )
    prompts = [list(range(3, 43)), list(range(50, 55))]
    outs = llm.generate(
        prompts,
        [
            SamplingParams(max_tokens=6, ignore_eos=True),
            SamplingParams(max_tokens=3, prompt_logprobs=0, ignore_eos=True),
        ],
    )
    lines = _lines(path)
    assert lines and all(line["pid"] == os.getpid() for line in lines)
    keys = {
        "time",
        "duration_ms",
        "requests",
        "tokens",
        "prefill_requests",
        "prefill_tokens",
        "decode_requests",
    }
    assert keys | {"prompt_logprob_requests", "preempted", "running", "waiting", "pid"} == set(lines[0])
    # Every prompt token is computed once, and every output token but the last of each request.
    assert sum(line["prefill_tokens"] for line in lines) == 45
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    assert sum(line["tokens"] for line in lines) == 45 + generated - len(prompts)
    assert max(line["tokens"] for line in lines) <= 16
    assert all(line["requests"] == line["prefill_requests"] + line["decode_requests"] for line in lines)
    assert sum(line["prompt_logprob_requests"] for line in lines) == 1  # the short prompt, one chunk
    assert lines[0]["prefill_requests"] >= 1 and lines[-1]["running"] == 0 and lines[-1]["waiting"] == 0
    times = [line["time"] for line in lines]
    assert times == sorted(times) and all(line["duration_ms"] >= 0 for line in lines)
    # Appended: a second run adds its steps after the first's.
    llm.generate([[7, 8, 9]], SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(_lines(path)) == len(lines) + 2


def test_step_log_bad_path_is_a_clear_error(tiny_model_dirs, tmp_path) -> None:
    model = tiny_model_dirs["LlamaForCausalLM"]
    with pytest.raises(ValueError, match="its folder does not exist"):
        EngineArgs(model=model, step_log=str(tmp_path / "no-such-dir" / "steps.jsonl"))
    with pytest.raises(ValueError, match="step_log must be a file path"):
        EngineArgs(model=model, step_log="")
    with pytest.raises(ValueError, match="cannot open the step log"):
        LLM(model, dtype="float32", num_kv_blocks=16, step_log=str(tmp_path))  # a folder
