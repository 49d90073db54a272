"""Predicted outputs (`SamplingParams.prediction`, OpenAI's `prediction`): outputs identical with
and without a prediction (greedy and seeded, n > 1, stop strings, max_tokens inside an accepted
draft, structured output, preemption), with and without a speculative_config; the accepted /
rejected counts exact on constructed cases; the alignment after edits; limits and bad shapes.
The KV accounting invariant is checked after every step (tests/conftest.py)."""

from __future__ import annotations

import random

import pytest

from pagoda import LLM, SamplingParams
from pagoda.limits import LimitError, RequestLimits
from pagoda.spec.prediction import MATCH_MIN, PREDICTION_NUM_DRAFTS, Prediction
from tiny_models import structured_batch_params

ARCH = "LlamaForCausalLM"


def _prompts(n: int = 4) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 380) for _ in range(8)] for _ in range(n)]


def _edit(tokens: list[int], seed: int) -> list[int]:
    """A few short spans replaced, one dropped and one inserted, as an editor's earlier version."""
    rng = random.Random(seed)
    out = list(tokens)
    for _ in range(2):
        i = rng.randrange(0, max(1, len(out) - 4))
        out[i : i + rng.randrange(1, 4)] = [rng.randrange(3, 380) for _ in range(rng.randrange(1, 4))]
    del out[len(out) // 2 : len(out) // 2 + 2]
    return out


def _outputs(llm: LLM, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    llm.engine.core.check_invariants()
    return outs


def _llm(path: str, **kwargs) -> LLM:
    kwargs.setdefault("num_kv_blocks", 512)
    return LLM(path, dtype="float32", **kwargs)


def _with_predictions(params: list[SamplingParams], predictions) -> list[SamplingParams]:
    return [
        SamplingParams(**{**p.__dict__, "prediction": q}) for p, q in zip(params, predictions, strict=True)
    ]


def _on_off(path: str, prompts, params: list[SamplingParams], edit: bool = True, **kwargs):
    """Outputs without a prediction, then with each output's edited version (or the output itself)
    as its prediction (the first sample's for n > 1); asserts they are identical and that
    predictions were accepted."""
    llm = _llm(path, **kwargs)
    off = _outputs(llm, prompts, params)
    predictions = [list(o.outputs[0].token_ids) for o in off]
    if edit:
        predictions = [_edit(p, 1 + i) for i, p in enumerate(predictions)]
    on = _outputs(llm, prompts, _with_predictions(params, predictions))
    key = [[(tuple(c.token_ids), c.text, c.finish_reason) for c in o.outputs] for o in off]
    assert [[(tuple(c.token_ids), c.text, c.finish_reason) for c in o.outputs] for o in on] == key
    assert all(c.accepted_prediction_tokens is None for o in off for c in o.outputs)
    accepted = sum(c.accepted_prediction_tokens for o in on for c in o.outputs)
    assert accepted > 0
    return on, llm


GREEDY = SamplingParams(temperature=0, max_tokens=40)


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_on_off_identical_without_speculative_config(tiny_model_dirs, arch, seeded):
    params = [
        SamplingParams(temperature=0.8, top_k=20, seed=i, max_tokens=40) if seeded else GREEDY
        for i in range(4)
    ]
    _, llm = _on_off(tiny_model_dirs[arch], _prompts(4), params)
    stats = llm.engine.stats()
    assert stats.spec_num_draft_tokens > stats.spec_num_accepted_tokens > 0  # edits are rejected


def test_with_ngram_n_and_preemption(tiny_model_dirs):
    """Combined with n-gram drafts (which continue a prediction's), n > 1 samples each aligning on
    its own, and preemption with chunked prefill."""
    spec = {"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    params = [SamplingParams(temperature=1.0, seed=3 + i, n=3, max_tokens=30) for i in range(3)]
    params.append(SamplingParams(temperature=0, n=2, max_tokens=30))
    prompts = _prompts(3) + [list(range(3, 60))]
    _, llm = _on_off(
        tiny_model_dirs[ARCH],
        prompts,
        params,
        speculative_config={**spec, "max_running": 64},
        num_kv_blocks=40,
        block_size=4,
        max_num_batched_tokens=16,
    )
    assert llm.engine.core.scheduler.stats.num_preemptions > 0


def test_stop_strings_and_max_tokens_inside_a_draft(tiny_model_dirs):
    path = tiny_model_dirs[ARCH]
    llm = _llm(path)
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=40) for i in range(4)]
    off = _outputs(llm, _prompts(), params)
    tok = llm.engine.tokenizer
    stops, prompts = [], []
    for prompt, p, o in zip(_prompts(), params, off, strict=True):
        # A stop string first found past the 10th token (inside some step's accepted drafts).
        ids, text = o.outputs[0].token_ids, o.outputs[0].text
        for k in range(10, len(ids) - 2):
            s = tok.decode(ids[k : k + 2])
            if s and "\ufffd" not in s and text.find(s) == len(tok.decode(ids[:k])):
                stops.append(SamplingParams(**{**p.__dict__, "stop": [s]}))
                prompts.append(prompt)
                break
    assert len(stops) >= 2
    on, _ = _on_off(path, prompts, stops, edit=False)
    assert all(c.finish_reason == "stop" for o in on for c in o.outputs)
    for max_tokens in (3, 7, 17, 18, 19):  # the drafts stop short of max_tokens
        params = [SamplingParams(temperature=0, max_tokens=max_tokens)] * 2
        on, _ = _on_off(path, _prompts(2), params, edit=False)
        assert all(
            len(c.token_ids) == max_tokens and c.finish_reason == "length" for o in on for c in o.outputs
        )


def test_with_structured_output(tiny_model_dirs):
    """Grammar-forced drafts first, the prediction's (cut where the grammar rejects them) after."""
    params = structured_batch_params()
    params += [GREEDY]
    _, llm = _on_off(tiny_model_dirs[ARCH], _prompts(5), params, jump_forward_max_running=64)
    # Accepted drafts are counted per proposer: grammar-forced ones apart from the prediction's.
    stats = llm.engine.stats()
    assert 0 < stats.jump_forward_accepted <= stats.jump_forward_drafts
    assert stats.spec_num_accepted_tokens > stats.jump_forward_accepted


def _varied_output(llm: LLM) -> tuple[list[int], SamplingParams]:
    """A prompt and seeded params whose output repeats no MATCH_MIN-gram (so that the counts of a
    constructed prediction follow from the rules alone)."""
    for seed in range(20):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=30)
        out = _outputs(llm, [_prompts(1)[0]], params)[0].outputs[0].token_ids
        grams = [tuple(out[i : i + MATCH_MIN]) for i in range(len(out) - MATCH_MIN + 1)]
        if len(set(grams)) == len(grams):
            return out, params
    raise AssertionError("no varied output found")


def test_usage_counts_exact(tiny_model_dirs):
    llm = _llm(tiny_model_dirs[ARCH])
    out, params = _varied_output(llm)
    prompt = _prompts(1)[0]

    def run(prediction, **more):
        before = llm.engine.stats().num_steps
        p = SamplingParams(**{**params.__dict__, "prediction": prediction, **more})
        c = _outputs(llm, [prompt], p)[0].outputs[0]
        return c, llm.engine.stats().num_steps - before

    # The exact output as the prediction: every draft is accepted, 16 per step after the prefill's
    # token: 1 + 17 + 12 tokens in 3 steps, the last token of each sampled after its drafts.
    c, steps = run(out)
    assert c.token_ids == out and steps == 3
    assert (c.accepted_prediction_tokens, c.rejected_prediction_tokens) == (len(out) - 3, 0)
    # Ten right tokens, then tokens the output never has: after the prefill's token the second
    # step drafts 9 right and 7 wrong ones, and no MATCH_MIN-gram of the output re-aligns.
    junk = [t for t in range(3, 380) if t not in out][:20]
    c, _ = run(out[:10] + junk)
    assert c.token_ids == out
    assert (c.accepted_prediction_tokens, c.rejected_prediction_tokens) == (9, PREDICTION_NUM_DRAFTS - 9)
    # A stop token in the prediction: drafts end before it (it is sampled, after them).
    j = next(i for i in range(5, len(out)) if out[i] not in out[:i])
    c, steps = run(out, stop_token_ids=[out[j]])
    assert c.token_ids == out[: j + 1] and c.finish_reason == "stop" and steps == 2
    assert (c.accepted_prediction_tokens, c.rejected_prediction_tokens) == (j - 1, 0)


def test_text_prediction_and_load_gate(tiny_model_dirs):
    """A text prediction is tokenized as the model writes it; without speculative_config the CPU
    gate (4 running) applies: no prediction drafts while more requests run."""
    llm = _llm(tiny_model_dirs[ARCH], max_num_seqs=8)
    prompts = _prompts(8)
    off = _outputs(llm, prompts, [GREEDY] * 8)
    tok = llm.engine.tokenizer
    ids = [o.outputs[0].token_ids for o in off]
    params = [SamplingParams(temperature=0, max_tokens=40, prediction=tok.decode(i)) for i in ids]
    before = llm.engine.stats().spec_num_draft_tokens
    on = _outputs(llm, prompts, params)
    assert [o.outputs[0].token_ids for o in on] == ids
    # 8 running: the gate stays closed until at most 4 are left (none finish early here).
    assert llm.engine.stats().spec_num_draft_tokens == before
    on = _outputs(llm, prompts[:2], params[:2])
    assert [o.outputs[0].token_ids for o in on] == ids[:2]
    assert llm.engine.stats().spec_num_draft_tokens > before


def test_alignment_after_edits():
    p = Prediction([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
    assert p.propose([], [], 4) == [1, 2, 3, 4]
    p.observe([1, 2], [1, 2])
    assert p.cursor == 2 and p.propose([], [1, 2], 3) == [3, 4, 5]
    assert p.propose([3, 4], [1, 2], 2) == [5, 6]  # continuing an earlier proposer's drafts
    # An edited span: 3 4 became 30 40 41; no drafts until MATCH_MIN tokens match again.
    p.observe([30, 40, 41], [1, 2, 30, 40, 41])
    assert p.cursor is None and p.propose([], [2, 30, 40, 41], 3) == []
    p.observe([5, 6, 7], [30, 40, 41, 5, 6, 7])
    assert p.cursor == 7 and p.propose([], [41, 5, 6, 7], 3) == [8, 9, 10]
    # Among equally long matches, the first at or after the last alignment.
    q = Prediction([7, 8, 9, 1, 7, 8, 9, 2, 7, 8, 9, 3])
    q.observe([7, 8, 9, 1, 7], [7, 8, 9, 1, 7])
    q.observe([8, 9, 5, 7, 8, 9], [8, 9, 5, 7, 8, 9])
    assert q.propose([], [9, 5, 7, 8, 9], 1) == [2]


def test_bad_predictions(tiny_model_dirs):
    with pytest.raises(ValueError, match="prediction must be"):
        SamplingParams(prediction={"type": "content"})
    with pytest.raises(ValueError, match="prediction must be"):
        SamplingParams(prediction=[1, -2])
    with pytest.raises(LimitError, match="max-prediction-chars"):
        RequestLimits(max_prediction_chars=4).check_params(SamplingParams(prediction="hello"))
    llm = _llm(tiny_model_dirs[ARCH])
    with pytest.raises(ValueError, match="prediction token id 100000"):
        llm.generate([[5, 6]], SamplingParams(prediction=[3, 100000]), use_tqdm=False)
    # An empty prediction drafts nothing and reports zero counts.
    out = _outputs(llm, [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=5, prediction=""))
    c = out[0].outputs[0]
    assert (c.accepted_prediction_tokens, c.rejected_prediction_tokens) == (0, 0)


@pytest.mark.slow
def test_bench_offline_code_edit_workload(tiny_llama_dir, capsys):
    from pagoda.entrypoints.cli import main

    args = ["bench", "offline", "--model", tiny_llama_dir, "--workload", "code-edit", "--dtype", "float32"]
    code = main([*args, "--output-len", "40", "--input-len", "12"])
    out = capsys.readouterr().out
    assert code == 0
    assert "outputs identical: True" in out and "accepted," in out and "saved)" in out
