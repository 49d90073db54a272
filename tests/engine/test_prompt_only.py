"""Prompt-only requests (SamplingParams(max_tokens=0)): the prompt is computed into the prefix
cache and scored if asked, nothing is sampled, no LM-head row runs that nobody reads, and the
request finishes with reason "length"; batches mixing them with ordinary requests; no KV leak."""

from __future__ import annotations

import pytest
from tests.engine.test_prompt_logprobs import assert_clean, check_entries, hf_logprobs, prompts

from pagoda import LLM, SamplingParams


def _llm(tiny_model_dirs, arch: str = "LlamaForCausalLM", **kwargs) -> LLM:
    return LLM(tiny_model_dirs[arch], dtype="float32", num_kv_blocks=128, block_size=4, **kwargs)


def _logits_rows(llm: LLM) -> list[int]:
    """Wrap the executor so that each step's LM-head row count (all calls) is recorded."""
    rows: list[int] = []
    executor = llm.engine.core.executor
    execute, compute = executor.execute, executor.compute_logits

    def counted_execute(batch):
        rows.append(len(batch.logits_rows))
        return execute(batch)

    def counted_compute(r):
        rows[-1] += len(r)
        return compute(r)

    executor.execute, executor.compute_logits = counted_execute, counted_compute
    return rows


def test_prompt_only_params():
    p = SamplingParams(max_tokens=0)
    assert p.prompt_only and not SamplingParams(max_tokens=1).prompt_only
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 0"):
        SamplingParams(max_tokens=-1)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=True)
    with pytest.raises(ValueError, match=r"min_tokens \(1\) must be <= max_tokens \(0\)"):
        SamplingParams(max_tokens=0, min_tokens=1)
    with pytest.raises(ValueError, match="structured_outputs needs max_tokens >= 1"):
        SamplingParams(max_tokens=0, structured_outputs={"regex": "a"})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="prediction needs max_tokens >= 1"):
        SamplingParams(max_tokens=0, prediction="x")


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM"])
def test_prompt_only_logprobs_equal_a_one_token_request(tiny_model_dirs, arch):
    """The prompt logprobs of a prompt-only request equal those of a request that samples a token
    (and transformers'); it generates nothing and finishes with "length"."""
    llm = _llm(tiny_model_dirs, arch)
    ps = prompts(4, seed=7, lo=3)
    only = llm.generate(ps, SamplingParams(max_tokens=0, prompt_logprobs=2))
    llm.reset_prefix_cache()
    one = llm.generate(ps, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2))
    for prompt, a, b in zip(ps, only, one, strict=True):
        (c,) = a.outputs
        assert c.token_ids == [] and c.text == "" and c.finish_reason == "length"
        assert a.finished and a.prompt_token_ids == prompt
        check_entries(tiny_model_dirs[arch], prompt, a.prompt_logprobs, 2)
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True):
            assert {t: lp.logprob for t, lp in x.items()} == {t: lp.logprob for t, lp in y.items()}
    assert_clean(llm)


def test_prompt_only_runs_no_lm_head_row_and_fills_the_cache(tiny_model_dirs):
    """A prompt-only request without prompt logprobs runs no LM-head row; its KV serves the next
    request up to the prompt's last token; with logprob_start_len only the scored rows run."""
    llm = _llm(tiny_model_dirs)
    rows = _logits_rows(llm)
    prompt = prompts(1, seed=3, lo=30, hi=30)[0]
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=0))
    assert out.outputs[0].token_ids == [] and out.num_cached_tokens == 0
    assert sum(rows) == 0
    assert llm.engine.stats().num_computed_tokens == 30
    rows.clear()
    (again,) = llm.generate([prompt + [5, 6]], SamplingParams(max_tokens=2, temperature=0))
    assert again.num_cached_tokens == 30  # the whole prompt, its last token included (a tail)
    assert sum(rows) == 2  # one sampled row per step
    rows.clear()
    (scored,) = llm.generate(
        [prompt + [7, 8, 9]], SamplingParams(max_tokens=0, prompt_logprobs=0, logprob_start_len=31)
    )
    assert sum(rows) == 2  # rows 30 and 31 score tokens 31 and 32; no row for the last token
    assert [e is None for e in scored.prompt_logprobs] == [True] * 31 + [False] * 2
    check_entries(tiny_model_dirs["LlamaForCausalLM"], prompt + [7, 8, 9], scored.prompt_logprobs, 0, 31)
    assert_clean(llm)


def test_prompt_only_mixed_with_ordinary_requests(tiny_model_dirs):
    """A batch of prompt-only and ordinary requests (chunked prefill, n > 1 too): the ordinary
    ones give the tokens they give alone, the prompt-only ones finish with no tokens."""
    llm = _llm(tiny_model_dirs, max_num_batched_tokens=24)
    ps = prompts(6, seed=11, lo=5, hi=40)
    gen = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(ps[::2], gen)]
    llm.reset_prefix_cache()
    params = [gen, SamplingParams(max_tokens=0), gen, SamplingParams(max_tokens=0, n=2, prompt_logprobs=0)]
    params += [gen, SamplingParams(max_tokens=0, prompt_logprobs=1)]
    outs = llm.generate(ps, params)
    assert [o.outputs[0].token_ids for o in outs[::2]] == alone
    for out in outs[1::2]:
        assert all(c.token_ids == [] and c.finish_reason == "length" for c in out.outputs)
    assert len(outs[3].outputs) == 2
    check_entries(tiny_model_dirs["LlamaForCausalLM"], ps[5], outs[5].prompt_logprobs, 1)
    assert_clean(llm)


def test_prompt_only_under_kv_pressure_and_abort(tiny_model_dirs):
    """Prompt-only requests preempted for blocks, and aborted while waiting, leak no block."""
    llm = LLM(tiny_model_dirs["LlamaForCausalLM"], dtype="float32", num_kv_blocks=12, block_size=4)
    ps = prompts(8, seed=5, lo=10, hi=20)
    outs = llm.generate(
        ps, [SamplingParams(max_tokens=0, prompt_logprobs=0)] * 4 + [SamplingParams(max_tokens=6)] * 4
    )
    for prompt, out in zip(ps[:4], outs[:4], strict=True):
        check_entries(tiny_model_dirs["LlamaForCausalLM"], prompt, out.prompt_logprobs, 0)
    engine = llm.engine
    engine.add_request("a", ps[0], SamplingParams(max_tokens=0))
    engine.abort_request(["a"])
    assert_clean(llm)


def test_prompt_only_streams_one_final_output(tiny_model_dirs):
    llm = _llm(tiny_model_dirs)
    engine = llm.engine
    engine.add_request(
        "s", prompts(1, seed=2)[0], SamplingParams(max_tokens=0, prompt_logprobs=0), stream=True
    )
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    (out,) = outs
    assert out.finished and out.outputs[0].finish_reason == "length" and out.prompt_logprobs is not None
    assert_clean(llm)


def test_next_token_ids_score_the_token_after_the_prompt(tiny_model_dirs):
    """SamplingParams.next_token_ids: each id's logprob and rank after the prompt, equal to
    transformers' (and to the prompt logprob of that token as the next prompt token), from one
    LM-head row; nothing is sampled."""
    path = tiny_model_dirs["Qwen2ForCausalLM"]
    llm = _llm(tiny_model_dirs, "Qwen2ForCausalLM")
    rows = _logits_rows(llm)
    prompt = prompts(1, seed=9, lo=20, hi=20)[0]
    targets = [7, 3, 7, 200]
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=0, next_token_ids=targets))
    assert sum(rows) == 1 and out.outputs[0].token_ids == []
    ref = hf_logprobs(path, tuple(prompt))[-1]
    assert set(out.next_token_logprobs) == {3, 7, 200}
    for t, lp in out.next_token_logprobs.items():
        assert abs(lp.logprob - ref[t].item()) < 1e-4
        assert lp.rank == int((ref > ref[t]).sum()) + 1 and lp.decoded_token is not None
    (longer,) = llm.generate([prompt + [200]], SamplingParams(max_tokens=0, prompt_logprobs=0))
    assert abs(longer.prompt_logprobs[-1][200].logprob - out.next_token_logprobs[200].logprob) < 1e-5
    plain = llm.generate([prompt], SamplingParams(max_tokens=0))[0]
    assert plain.next_token_logprobs is None
    # In one step with requests that sample (the sampler's rows and the scored rows apart).
    greedy = SamplingParams(max_tokens=3, temperature=0)
    alone = llm.generate([prompt[:12]], greedy)[0].outputs[0].token_ids
    llm.reset_prefix_cache()
    mixed = llm.generate(
        [prompt[:12], prompt], [greedy, SamplingParams(max_tokens=0, next_token_ids=targets)]
    )
    assert mixed[0].outputs[0].token_ids == alone
    for t, lp in mixed[1].next_token_logprobs.items():
        assert abs(lp.logprob - ref[t].item()) < 1e-4
    # Several in one step, asking different numbers of ids: each row is scored as if alone.
    others = prompts(3, seed=10, lo=5, hi=30)
    asked = [[5], targets, list(range(40, 0, -3))]
    before = len(rows)
    batched = llm.generate(others, [SamplingParams(max_tokens=0, next_token_ids=a) for a in asked])
    assert rows[before:] == [3]  # one step, one LM-head row each
    for p, a, out_b in zip(others, asked, batched, strict=True):
        ref_p = hf_logprobs(path, tuple(p))[-1]
        assert set(out_b.next_token_logprobs) == set(a)
        for t, lp in out_b.next_token_logprobs.items():
            assert abs(lp.logprob - ref_p[t].item()) < 1e-4
            assert lp.rank == int((ref_p > ref_p[t]).sum()) + 1
    with pytest.raises(ValueError, match="next_token_ids needs max_tokens 0"):
        SamplingParams(max_tokens=1, next_token_ids=[1])
    with pytest.raises(ValueError, match="next_token_ids must be a list of 1 to 256"):
        SamplingParams(max_tokens=0, next_token_ids=[])
    with pytest.raises(ValueError, match="next_token_ids entry 99999 is not in"):
        llm.generate([prompt], SamplingParams(max_tokens=0, next_token_ids=[99999]))
    assert_clean(llm)
