"""Speculative decoding end to end: outputs identical with it on and off (greedy and seeded), for
the n-gram proposer alone and combined with grammar-forced drafts, through preemption, chunked
prefill, prefix hits, n > 1, stop strings and max_tokens inside an accepted draft. The KV
accounting invariant is checked after every step (tests/conftest.py)."""

from __future__ import annotations

import pytest

from pagoda import LLM, SamplingParams
from tiny_models import structured_batch_params

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
ARCH = "LlamaForCausalLM"


def _prompts(n: int = 6) -> list[list[int]]:
    # Repeating patterns, so that the lookup finds matches in the prompt from the first step.
    return [([5 + i, 9, 40 + i, 17, 3] * 6)[: 7 + 3 * i] for i in range(n)]


def _run(path: str, spec, prompts, params, **kwargs):
    kwargs.setdefault("num_kv_blocks", 512)
    llm = LLM(path, dtype="float32", speculative_config=spec, **kwargs)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    llm.engine.core.check_invariants()
    return [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outs], llm


def _on_off(path, prompts, params, spec=NGRAM, expect_drafts=True, **kwargs):
    off, _ = _run(path, None, prompts, params, **kwargs)
    on, llm = _run(path, {**spec, "max_running": 64}, prompts, params, **kwargs)
    assert on == off
    stats = llm.engine.stats()
    if not expect_drafts:
        return on, llm
    assert stats.spec_num_draft_tokens > 0
    assert 0 < stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens
    return on, llm


GREEDY = SamplingParams(temperature=0, max_tokens=40)
SEEDED = [SamplingParams(temperature=0.3, top_k=3, seed=i, max_tokens=40) for i in range(6)]


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_on_off_identical(tiny_model_dirs, arch, params):
    _, llm = _on_off(tiny_model_dirs[arch], _prompts(), params)
    core = llm.engine.core
    assert core.scheduler.stats.num_rejected_draft_tokens > 0


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_preemption_and_chunked_prefill(tiny_model_dirs, params):
    prompts = _prompts(6) + [list(range(3, 60))]  # a long prompt, prefilled in chunks
    seeded = params if isinstance(params, SamplingParams) else [*params, params[0]]
    _, llm = _on_off(
        tiny_model_dirs[ARCH], prompts, seeded, num_kv_blocks=30, block_size=4, max_num_batched_tokens=16
    )
    assert llm.engine.core.scheduler.stats.num_preemptions > 0


def test_prefix_hits_and_n(tiny_model_dirs):
    prompts = _prompts(3) * 2  # the second three hit the prefix cache
    params = [SamplingParams(temperature=1.0, seed=7 + i, n=3, max_tokens=30) for i in range(6)]
    params[0] = SamplingParams(temperature=0, n=2, max_tokens=30)
    _, llm = _on_off(tiny_model_dirs[ARCH], prompts, params, block_size=4)
    assert llm.engine.stats().prefix_cache_hits > 0


def test_stop_strings_and_max_tokens_inside_a_draft(tiny_model_dirs):
    path = tiny_model_dirs[ARCH]
    off, _ = _run(path, None, _prompts(), SamplingParams(temperature=0, max_tokens=40))
    texts = [o[0][1] for o in off]
    # A stop string from the middle of each greedy output (found inside a step's accepted tokens).
    params = [
        SamplingParams(temperature=0, max_tokens=40, stop=[t[len(t) // 2 : len(t) // 2 + 3]]) for t in texts
    ]
    outs, _ = _on_off(path, _prompts(), params)
    assert all(c[0][2] == "stop" for c in outs)
    # Every max_tokens from 1 to 12: the drafts stop short of it (and with 1 or 2 there is no room).
    for max_tokens in range(1, 13):
        params = SamplingParams(temperature=0, max_tokens=max_tokens)
        outs, _ = _on_off(path, _prompts(2), params, expect_drafts=max_tokens > 5)
        assert all(len(c[0][0]) == max_tokens and c[0][2] == "length" for c in outs)


def test_combined_with_structured_output(tiny_model_dirs):
    params = structured_batch_params()
    params += [SamplingParams(temperature=0, max_tokens=40)] * 2  # unconstrained in the same batch
    _on_off(tiny_model_dirs[ARCH], _prompts(), params, jump_forward_max_running=64)


def test_load_gate(tiny_model_dirs):
    """Beyond max_running requests no n-gram drafts are proposed."""
    _, llm = _run(tiny_model_dirs[ARCH], {**NGRAM, "max_running": 2}, _prompts(6), GREEDY, max_num_seqs=8)
    gated = llm.engine.stats().spec_num_draft_tokens
    _, llm = _run(tiny_model_dirs[ARCH], {**NGRAM, "max_running": 8}, _prompts(6), GREEDY, max_num_seqs=8)
    assert gated < llm.engine.stats().spec_num_draft_tokens
    _, llm = _run(tiny_model_dirs[ARCH], {**NGRAM, "max_running": 2}, _prompts(1), GREEDY)
    assert llm.engine.stats().spec_num_draft_tokens > 0


def test_ended_requests_leave_no_drafting_state(tiny_model_dirs):
    """The drafter holds one record per live request (waiting or running: its n-gram index, its
    prediction) and none for a request that finished, or was aborted running or waiting."""
    llm = LLM(
        tiny_model_dirs[ARCH],
        dtype="float32",
        num_kv_blocks=512,
        max_num_seqs=2,
        speculative_config={**NGRAM, "max_running": 64},
    )
    engine, core = llm.engine, llm.engine.core
    records = core.drafter._records
    prompts = _prompts(4)
    for i, prompt in enumerate(prompts):
        prediction = prompt[-6:] if i % 2 else None
        engine.add_request(
            f"r{i}",
            prompt,
            SamplingParams(temperature=0, max_tokens=6 if i == 0 else 30, prediction=prediction),
        )
    assert records.keys() == core.scheduler.requests.keys() and len(records) == 4
    assert records["r1"].prediction is not None and records["r0"].prediction is None
    while "r0" in core.scheduler.requests:  # r0 and r1 run, r2 and r3 wait (max_num_seqs)
        engine.step()
        assert records.keys() == core.scheduler.requests.keys()
    assert records["r1"].ngram is not None  # r1 drafted
    assert {r.request_id for r in core.scheduler.waiting} == {"r2", "r3"}
    engine.abort_request(["r1", "r3"])  # one running, one waiting
    assert records.keys() == core.scheduler.requests.keys() == {"r2"}
    while engine.has_unfinished_requests():
        engine.step()
    assert core.drafter.num_records == 0
