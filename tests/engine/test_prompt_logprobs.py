"""Prompt logprobs (SamplingParams.prompt_logprobs, vLLM's format) against transformers' fp32
logits: every architecture, prefix-cache hits, chunked prefill, preemption, batches mixed with
ordinary requests, n > 1, logprob_start_len; and vLLM's dict prompts."""

from __future__ import annotations

import functools
import pickle
import random

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from pagoda import LLM, SamplingParams
from pagoda.engine.messages import EngineCoreRequest
from pagoda.limits import RequestLimits
from pagoda.outputs import Logprob

ARCHS = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
TOL = 1e-4


@functools.cache
def _hf(path: str):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@functools.cache
def hf_logprobs(path: str, prompt: tuple[int, ...]) -> torch.Tensor:
    """[len(prompt), V]: row i is log_softmax of the logits at position i (predicting token i + 1)."""
    with torch.inference_mode():
        logits = _hf(path)(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def check_entries(
    path: str, prompt: list[int], entries, k: int, start: int = 1, decoded: bool = True
) -> None:
    """`entries` is vLLM's prompt_logprobs: None before `start`, then the prompt token (with its
    rank) plus the top-k, all equal to transformers' within TOL."""
    ref = hf_logprobs(path, tuple(prompt))
    assert len(entries) == len(prompt)
    assert all(e is None for e in entries[:start])
    for i in range(start, len(prompt)):
        entry = entries[i]
        assert entry is not None, f"no entry at position {i}"
        row = ref[i - 1]
        tok = prompt[i]
        got = entry[tok]
        assert isinstance(got, Logprob)
        assert abs(got.logprob - row[tok].item()) < TOL, (i, got.logprob, row[tok].item())
        near = int(((row - row[tok]).abs() < TOL).sum())  # ties within the tolerance may swap
        assert abs(got.rank - (int((row > row[tok]).sum()) + 1)) < near
        top = sorted((lp.rank, t, lp.logprob) for t, lp in entry.items() if lp.rank <= k)
        assert len(top) == k
        for (_rank, t, lp), v in zip(top, row.topk(k).values.tolist(), strict=True):
            assert abs(lp - v) < TOL and abs(row[t].item() - lp) < TOL
        assert (got.decoded_token is not None) == decoded


def prompts(n: int, seed: int, lo: int = 2, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def assert_clean(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    engine.core.check_invariants()
    engine.reset_prefix_cache()
    assert engine.core.kv.pool.num_free == engine.core.kv.num_blocks


@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_logprobs_match_transformers(tiny_model_dirs, arch):
    path = tiny_model_dirs[arch]
    llm = LLM(path, dtype="float32", num_kv_blocks=128, block_size=4)
    ps = prompts(4, seed=1)
    outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=3))
    for p, out in zip(ps, outs, strict=True):
        check_entries(path, p, out.prompt_logprobs, 3)
        assert len(out.outputs[0].token_ids) == 3
    assert_clean(llm)


@pytest.mark.parametrize("arch", ARCHS)
def test_exact_on_prefix_hits_and_chunked_prefill(tiny_model_dirs, arch):
    """A prompt whose prefix is cached is still scored from position 1 (the cache is not read
    below the first scored position); small chunks score each chunk's rows."""
    path = tiny_model_dirs[arch]
    llm = LLM(path, dtype="float32", num_kv_blocks=128, block_size=4, max_num_batched_tokens=6)
    rng = random.Random(2)
    shared = [rng.randrange(3, 256) for _ in range(30)]
    full = shared + [rng.randrange(3, 256) for _ in range(9)]
    llm.generate([shared], SamplingParams(temperature=0, max_tokens=1))  # caches the prefix
    (out,) = llm.generate([full], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2))
    check_entries(path, full, out.prompt_logprobs, 2)
    assert out.num_cached_tokens == 0
    # From a start position, the prefix before it is a cache hit and only the rest is scored.
    (out,) = llm.generate(
        [full], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1, logprob_start_len=33)
    )
    assert out.num_cached_tokens == 32
    check_entries(path, full, out.prompt_logprobs, 1, start=33)
    assert_clean(llm)


def test_batched_with_ordinary_requests_n_and_preemption(tiny_model_dirs):
    path = tiny_model_dirs["Qwen2ForCausalLM"]
    ps = prompts(12, seed=5, lo=3, hi=36)
    params = [
        SamplingParams(temperature=0, max_tokens=6, n=1 + i % 2, prompt_logprobs=i % 3 if i % 2 else None)
        for i in range(len(ps))
    ]
    for kwargs in ({"num_kv_blocks": 128}, {"num_kv_blocks": 14, "max_num_batched_tokens": 12}):
        llm = LLM(path, dtype="float32", block_size=4, **kwargs)
        llm.generate(ps[:4], SamplingParams(temperature=0, max_tokens=1))  # some prefixes cached
        outs = llm.generate(ps, params)
        plain = LLM(path, dtype="float32", block_size=4, num_kv_blocks=128).generate(
            ps, [SamplingParams(temperature=0, max_tokens=6, n=p.n) for p in params]
        )
        for p, sp, out, ref in zip(ps, params, outs, plain, strict=True):
            if sp.prompt_logprobs is None:
                assert out.prompt_logprobs is None
            else:
                check_entries(path, p, out.prompt_logprobs, sp.prompt_logprobs)
            assert [c.token_ids for c in out.outputs] == [c.token_ids for c in ref.outputs]
        if kwargs["num_kv_blocks"] == 14:
            assert llm.engine.core.scheduler.stats.num_preemptions > 0
        assert_clean(llm)


@pytest.mark.parametrize("slice_rows", [16, 23])
def test_logits_in_slices_beside_sampling_rows(tiny_model_dirs, monkeypatch, slice_rows):
    """Prompt-logprob rows go through the LM head in slices of a bounded size (first beside the
    step's sampling rows as far as one slice allows, then alone): with slices of 16 / 23 rows, a
    batch of ordinary requests and prompts of up to 90 scored rows still matches transformers."""
    from pagoda.worker import model_runner

    path = tiny_model_dirs["Qwen2ForCausalLM"]
    vocab = AutoConfig.from_pretrained(path).vocab_size
    monkeypatch.setattr(model_runner, "_PROMPT_LOGITS_BYTES", slice_rows * 4 * vocab)
    llm = LLM(path, dtype="float32", num_kv_blocks=256, block_size=4)
    assert llm.engine.core.runner._prompt_logit_rows == max(16, slice_rows)
    ps = prompts(6, seed=11, lo=20, hi=90)
    params = [
        SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=(0, 2, None)[i % 3])
        for i in range(len(ps))
    ]
    outs = llm.generate(ps, params)
    plain = LLM(path, dtype="float32", block_size=4, num_kv_blocks=256).generate(
        ps, SamplingParams(temperature=0, max_tokens=2)
    )
    for p, sp, out, ref in zip(ps, params, outs, plain, strict=True):
        if sp.prompt_logprobs is None:
            assert out.prompt_logprobs is None
        else:
            check_entries(path, p, out.prompt_logprobs, sp.prompt_logprobs)
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert_clean(llm)


def test_streaming_outputs_carry_prompt_logprobs_once(tiny_model_dirs):
    path = tiny_model_dirs["LlamaForCausalLM"]
    llm = LLM(path, dtype="float32", num_kv_blocks=64, block_size=4)
    engine = llm.engine
    prompt = prompts(1, seed=9, lo=20, hi=20)[0]
    engine.add_request(
        "s", prompt, SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=0), stream=True
    )
    seen = []
    while engine.has_unfinished_requests():
        seen += [o.prompt_logprobs for o in engine.step()]
    with_lps = [x for x in seen if x is not None]
    assert len(with_lps) == 1 and seen[0] is not None
    check_entries(path, prompt, with_lps[0], 0)


def test_core_sends_prompt_logprobs_once_as_data(tiny_model_dirs):
    """At the core's boundary: chunked prefill scores chunk by chunk, and the entries travel once,
    on the EngineCoreOutput with the first tokens, as plain picklable data."""
    path = tiny_model_dirs["LlamaForCausalLM"]
    llm = LLM(path, dtype="float32", num_kv_blocks=64, block_size=4, max_num_batched_tokens=6)
    core = llm.engine.core
    prompt = prompts(1, seed=11, lo=20, hi=20)[0]
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=1)
    core.add_request(EngineCoreRequest("c", prompt, params, 3, frozenset(), 0.0))
    outputs = []
    while core.has_unfinished():
        outputs += core.step()
    with_lps = [o for o in outputs if o.prompt_logprobs is not None]
    assert len(with_lps) == 1 and with_lps[0] is next(o for o in outputs if o.new_token_ids)
    sent = pickle.loads(pickle.dumps(with_lps[0]))
    assert sent == with_lps[0]
    check_entries(path, prompt, sent.prompt_logprobs, 1, decoded=False)  # text is the front end's
    core.check_invariants()


def test_dict_prompts(tiny_model_dirs):
    path = tiny_model_dirs["LlamaForCausalLM"]
    llm = LLM(path, dtype="float32", num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=4)
    ids = llm.tokenizer("hello world")["input_ids"]
    (by_text,) = llm.generate({"prompt": "hello world"}, params)
    (by_ids,) = llm.generate({"prompt_token_ids": ids}, params)
    both = llm.generate([{"prompt": "hello world"}, {"prompt_token_ids": ids}, "hello world"], params)
    assert by_text.prompt_token_ids == by_ids.prompt_token_ids == ids
    assert by_text.prompt == "hello world" and by_ids.prompt is None
    assert len({tuple(o.outputs[0].token_ids) for o in [by_text, by_ids, *both]}) == 1
    for bad, message in [
        ({"prompt": "a", "prompt_token_ids": ids}, "exactly one"),
        ({"prompt_token_ids": "abc"}, "'prompt_token_ids' must be a list of token ids"),
        ({"prompt": ids}, "'prompt' must be a string"),
        ({"multi_modal_data": {}, "prompt": "a"}, "'multi_modal_data' is not supported"),
        ({}, "exactly one"),
        ({"prompt_token_ids": [10**9]}, "is not an integer in"),
    ]:
        with pytest.raises(ValueError, match=message):
            llm.generate(bad, params)
    assert_clean(llm)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"prompt_logprobs": -1}, "prompt_logprobs must be an integer in"),
        ({"prompt_logprobs": 21}, "prompt_logprobs must be an integer in"),
        ({"prompt_logprobs": True}, "prompt_logprobs must be an integer in"),
        ({"logprob_start_len": 2}, "logprob_start_len needs prompt_logprobs"),
        ({"prompt_logprobs": 0, "logprob_start_len": -1}, "logprob_start_len must be"),
    ],
)
def test_bad_parameters(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_limits_and_start_past_the_prompt(tiny_model_dirs):
    path = tiny_model_dirs["LlamaForCausalLM"]
    llm = LLM(path, dtype="float32", num_kv_blocks=64, limits=RequestLimits(max_logprobs=2))
    with pytest.raises(ValueError, match="prompt_logprobs: 3 is more than this server allows"):
        llm.generate([[5, 6, 7]], SamplingParams(prompt_logprobs=3))
    with pytest.raises(ValueError, match=r"logprob_start_len \(3\) must be less than the prompt's length"):
        llm.generate([[5, 6, 7]], SamplingParams(prompt_logprobs=0, logprob_start_len=3))
    (out,) = llm.generate([[5]], SamplingParams(max_tokens=1, prompt_logprobs=0))
    assert out.prompt_logprobs == [None]
    assert_clean(llm)
