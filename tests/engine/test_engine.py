"""The offline engine end to end, against transformers as the reference (float32, greedy)."""

from __future__ import annotations

import functools
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagoda import LLM, SamplingParams

ARCHS = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
MAX_NEW = 12


@functools.cache
def _hf_model(path: str):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@functools.cache
def hf_greedy(path: str, prompt: tuple[int, ...], max_new: int) -> list[int]:
    model = _hf_model(path)
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def make_prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 60, vocab: int = 256) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def assert_clean(llm: LLM) -> None:
    """No request left and every block back in the pool (cached prefixes dropped)."""
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    engine.core.check_invariants()
    engine.reset_prefix_cache()
    kv = engine.core.kv
    assert kv.pool.num_free == kv.num_blocks


def check_greedy(llm: LLM, path: str, prompts: list[list[int]], max_new: int = MAX_NEW) -> None:
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_new))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == hf_greedy(path, tuple(prompt), max_new), (
            f"prompt of {len(prompt)} tokens"
        )
    assert_clean(llm)


@pytest.mark.parametrize("arch", ARCHS)
def test_single_and_batch_match_transformers(tiny_model_dirs, arch):
    path = tiny_model_dirs[arch]
    llm = LLM(path, dtype="float32", num_kv_blocks=256, block_size=8)
    check_greedy(llm, path, make_prompts(1, seed=1))
    check_greedy(llm, path, make_prompts(17, seed=2))


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(max_num_batched_tokens=16),  # chunked prefill: chunks smaller than the prompts
        dict(num_kv_blocks=12, block_size=4),  # a pool so small that preemption must happen
        dict(max_num_seqs=1),
        dict(max_num_seqs=64, max_num_batched_tokens=4096),
        dict(enable_prefix_caching=False, max_num_batched_tokens=24),
    ],
    ids=["chunked", "preemption", "one-seq", "large", "no-cache-chunked"],
)
def test_scheduling_variants_match_transformers(tiny_model_dirs, kwargs):
    path = tiny_model_dirs["Qwen2ForCausalLM"]
    kwargs = {"num_kv_blocks": 128, "block_size": 8, **kwargs}
    llm = LLM(path, dtype="float32", **kwargs)
    prompts = make_prompts(16, seed=3, lo=5, hi=40)
    check_greedy(llm, path, prompts)
    if "num_kv_blocks" in kwargs and kwargs["num_kv_blocks"] == 12:
        assert llm.engine.core.scheduler.stats.num_preemptions > 0


def test_prefix_cache_on_and_off_agree(tiny_model_dirs):
    """Heavy sharing, eviction churn, n > 1, chunked prefill and preemption, cache on vs off."""
    path = tiny_model_dirs["LlamaForCausalLM"]
    rng = random.Random(7)
    systems = [[rng.randrange(3, 256) for _ in range(rng.randint(20, 45))] for _ in range(4)]
    prompts = [
        rng.choice(systems) + [rng.randrange(3, 256) for _ in range(rng.randint(1, 12))] for _ in range(24)
    ]
    params = [SamplingParams(temperature=0, max_tokens=10, n=1 + i % 3) for i in range(len(prompts))]
    results = {}
    for caching in (True, False):
        llm = LLM(
            path,
            dtype="float32",
            num_kv_blocks=40,
            block_size=4,
            max_num_batched_tokens=32,
            enable_prefix_caching=caching,
        )
        outs = []
        for start in range(0, len(prompts), 8):  # several waves, so later ones hit the cache
            outs += llm.generate(prompts[start : start + 8], params[start : start + 8])
        results[caching] = [[c.token_ids for c in o.outputs] for o in outs]
        stats = llm.engine.core
        if caching:
            assert stats.kv.stats.hit_tokens > 0
            assert stats.kv.num_evicted_blocks > 0
        assert_clean(llm)
    assert results[True] == results[False]
    for prompt, completions in zip(prompts, results[True], strict=True):
        for tokens in completions:  # greedy: every sample equals the reference
            assert tokens == hf_greedy(path, tuple(prompt), 10)


def test_seeded_sampling_is_independent_of_the_batch(tiny_model_dirs):
    path = tiny_model_dirs["Qwen3ForCausalLM"]
    llm = LLM(path, dtype="float32", num_kv_blocks=128, block_size=8)
    target = make_prompts(1, seed=11)[0]
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=16)
    alone = llm.generate([target], params)[0].outputs[0].token_ids
    others = make_prompts(6, seed=12)
    mixed = llm.generate(
        others[:3] + [target] + others[3:],
        [SamplingParams(temperature=1.0, max_tokens=20)] * 3
        + [params]
        + [SamplingParams(temperature=0.7, max_tokens=5)] * 3,
    )
    assert mixed[3].outputs[0].token_ids == alone
    n_out = llm.generate([target], SamplingParams(temperature=1.0, seed=5, max_tokens=8, n=3))[0]
    assert len({tuple(c.token_ids) for c in n_out.outputs}) > 1  # samples of one prompt differ
    assert_clean(llm)


def test_outputs_text_logprobs_and_stop(tiny_model_dirs):
    path = tiny_model_dirs["LlamaForCausalLM"]
    llm = LLM(path, dtype="float32", num_kv_blocks=128, block_size=8)
    out = llm.generate("Hello, world", SamplingParams(temperature=0, max_tokens=8, logprobs=3))[0]
    comp = out.outputs[0]
    assert out.prompt == "Hello, world"
    assert comp.text == llm.tokenizer.decode(comp.token_ids, skip_special_tokens=True)
    assert len(comp.logprobs) == len(comp.token_ids)
    for tok, entry in zip(comp.token_ids, comp.logprobs, strict=True):
        assert tok in entry and entry[tok].rank == 1  # greedy picks the top token
        assert 3 <= len(entry) <= 4
    if len(comp.text) > 3:
        stop = comp.text[2:4]
        stopped = llm.generate("Hello, world", SamplingParams(temperature=0, max_tokens=8, stop=[stop]))[0]
        assert stopped.outputs[0].text == comp.text[: comp.text.index(stop)]
        assert stopped.outputs[0].finish_reason == "stop"
        assert stopped.outputs[0].stop_reason == stop
    chat = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=4, temperature=0))[0]
    assert len(chat.outputs[0].token_ids) >= 1
    assert_clean(llm)


def test_stop_token_and_min_tokens(tiny_model_dirs):
    path = tiny_model_dirs["LlamaForCausalLM"]
    llm = LLM(path, dtype="float32", num_kv_blocks=128, block_size=8)
    prompt = make_prompts(1, seed=21)[0]
    ref = hf_greedy(path, tuple(prompt), MAX_NEW)
    stop_tok = ref[3]
    first = ref.index(stop_tok)
    out = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=MAX_NEW, stop_token_ids=[stop_tok])
    )[0]
    assert out.outputs[0].token_ids == ref[: first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_tok
    out = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=6, min_tokens=6, stop_token_ids=[stop_tok])
    )[0]
    assert len(out.outputs[0].token_ids) == 6 and out.outputs[0].finish_reason == "length"
    assert stop_tok not in out.outputs[0].token_ids  # banned until min_tokens
    assert_clean(llm)


@pytest.mark.parametrize(
    "prompt,params,message",
    [
        ("", SamplingParams(), "empty"),
        ([1] * 300, SamplingParams(), "max_model_len"),
        ([10**9], SamplingParams(), "token id"),
        ([5, None], SamplingParams(), "token id"),
        ([5, True], SamplingParams(), "token id"),
    ],
)
def test_bad_requests_raise_clear_errors(tiny_model_dirs, prompt, params, message):
    llm = LLM(tiny_model_dirs["LlamaForCausalLM"], dtype="float32", num_kv_blocks=64, max_model_len=256)
    with pytest.raises(ValueError, match=message):
        llm.generate(prompt, params)
    assert_clean(llm)


def test_bad_parameters_and_models(tmp_path, tiny_model_dirs):
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    import json
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_model_dirs["LlamaForCausalLM"], bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        LLM(str(bad))
