"""The draft-model proposer (speculative method draft_model) end to end: greedy outputs identical
with it on and off for Llama and Qwen2 targets, with the target itself as its draft (then every
draft is accepted, which holds only if the draft's own KV is right) and with a different 1-layer
draft, through preemption, chunked prefill, prefix hits, n > 1, stop strings, max_tokens inside an
accepted draft and structured output; the draft's own block accounting after every step; the
errors for a draft that cannot serve. The target's KV invariant runs every step (tests/conftest.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.config import EngineArgs
from pagoda.models.synthetic import build_random_model
from tiny_models import structured_batch_params

ARCHS = ["LlamaForCausalLM", "Qwen2ForCausalLM"]
GREEDY = SamplingParams(temperature=0, max_tokens=40)


def _draft_config(path: str, k: int = 4, **extra) -> dict:
    return {"method": "draft_model", "model": path, "num_speculative_tokens": k, "max_running": 64, **extra}


def _dims(path: str) -> dict:
    """The tiny checkpoint's shape, as build_random_model takes it."""
    c = json.loads((Path(path) / "config.json").read_text())
    return dict(
        hidden_size=c["hidden_size"],
        num_layers=c["num_hidden_layers"],
        num_heads=c["num_attention_heads"],
        num_kv_heads=c["num_key_value_heads"],
        intermediate_size=c["intermediate_size"],
        vocab_size=c["vocab_size"],
    )


@pytest.fixture(scope="module")
def small_drafts(tmp_path_factory, tiny_model_dirs) -> dict[str, str]:
    """Architecture → a 1-layer random draft of the same family, shape and tokenizer (written
    next to a copy of the target by bench/drafts.py)."""
    from pagoda.bench.drafts import draft_model

    root = tmp_path_factory.mktemp("drafts")
    return {
        arch: draft_model(str(shutil.copytree(tiny_model_dirs[arch], root / arch)), 1, "random", seed=11)
        for arch in ARCHS
    }


def _prompts(n: int = 6) -> list[list[int]]:
    return [([5 + i, 9, 40 + i, 17, 3] * 6)[: 7 + 3 * i] for i in range(n)]


def _run(path, spec, prompts, params, **kwargs):
    kwargs.setdefault("num_kv_blocks", 512)
    llm = LLM(path, dtype="float32", speculative_config=spec, **kwargs)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    core = llm.engine.core
    core.check_invariants()
    draft = core.drafter.draft_model
    if draft is not None:  # every request ended: none holds draft blocks
        assert draft.num_records == 0 and draft.kv.usage == 0.0
    return [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outs], llm


def _on_off(path, draft, prompts, params, k=4, **kwargs):
    off, _ = _run(path, None, prompts, params, **kwargs)
    on, llm = _run(path, _draft_config(draft, k), prompts, params, **kwargs)
    assert on == off
    return on, llm


@pytest.mark.parametrize("arch", ARCHS)
def test_target_as_its_own_draft_accepts_everything(tiny_model_dirs, arch):
    path = tiny_model_dirs[arch]
    _, llm = _on_off(path, path, _prompts(), GREEDY)
    stats = llm.engine.stats()
    assert stats.spec_num_draft_tokens > 100
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens  # the draft's KV is right
    assert stats.num_steps < 6 * 40 / 4


@pytest.mark.parametrize("arch", ARCHS)
def test_small_draft_identical(tiny_model_dirs, small_drafts, arch):
    _, llm = _on_off(tiny_model_dirs[arch], small_drafts[arch], _prompts(), GREEDY)
    stats = llm.engine.stats()
    assert stats.spec_num_draft_tokens > 0
    assert stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    assert llm.engine.core.scheduler.stats.num_rejected_draft_tokens > 0


@pytest.mark.parametrize("self_draft", [True, False], ids=["self", "small"])
def test_preemption_and_chunked_prefill(tiny_model_dirs, small_drafts, self_draft):
    path = tiny_model_dirs["LlamaForCausalLM"]
    draft = path if self_draft else small_drafts["LlamaForCausalLM"]
    prompts = _prompts(6) + [list(range(3, 60))]  # a long prompt, prefilled in chunks
    _, llm = _on_off(path, draft, prompts, GREEDY, num_kv_blocks=30, block_size=4, max_num_batched_tokens=16)
    core = llm.engine.core
    assert core.scheduler.stats.num_preemptions > 0
    # The draft caught up on the long prompt in passes of at most 16 tokens.
    assert core.drafter.draft_model.max_tokens == 16


def test_prefix_hits_n_and_the_draft_prefix_cache(tiny_model_dirs):
    """A second round of the same prompts hits both prefix caches (the target's and the draft's)."""
    path = tiny_model_dirs["LlamaForCausalLM"]
    params = [SamplingParams(temperature=0, n=2, max_tokens=30)] * 3
    results = []
    for spec in (None, _draft_config(path)):
        llm = LLM(path, dtype="float32", num_kv_blocks=512, block_size=4, speculative_config=spec)
        rounds = [llm.generate(_prompts(3), params, use_tqdm=False) for _ in range(2)]
        results.append([[c.token_ids for c in o.outputs] for outs in rounds for o in outs])
        assert llm.engine.stats().prefix_cache_hits > 0
    assert results[0] == results[1]
    draft = llm.engine.core.drafter.draft_model
    assert draft.kv.stats.hit_tokens > 0
    assert draft.num_records == 0 and draft.kv.usage == 0.0
    assert llm.engine.stats().spec_num_accepted_tokens == llm.engine.stats().spec_num_draft_tokens


def test_stop_strings_and_max_tokens_inside_a_draft(tiny_model_dirs):
    path = tiny_model_dirs["LlamaForCausalLM"]
    off, _ = _run(path, None, _prompts(), GREEDY)
    texts = [o[0][1] for o in off]
    params = [
        SamplingParams(temperature=0, max_tokens=40, stop=[t[len(t) // 2 : len(t) // 2 + 3]]) for t in texts
    ]
    outs, _ = _on_off(path, path, _prompts(), params)
    assert all(c[0][2] == "stop" for c in outs)
    for max_tokens in (1, 2, 3, 7, 13):  # every draft is accepted: max_tokens falls inside one
        params = SamplingParams(temperature=0, max_tokens=max_tokens)
        outs, _ = _on_off(path, path, _prompts(2), params, k=5)
        assert all(len(c[0][0]) == max_tokens and c[0][2] == "length" for c in outs)


def test_combined_with_structured_output(tiny_model_dirs, small_drafts):
    params = structured_batch_params()
    params += [SamplingParams(temperature=0, max_tokens=40)] * 2  # unconstrained in the same batch
    path = tiny_model_dirs["LlamaForCausalLM"]
    for draft in (path, small_drafts["LlamaForCausalLM"]):
        _, llm = _on_off(path, draft, _prompts(), params, jump_forward_max_running=64)
        assert llm.engine.stats().spec_num_accepted_tokens > 0


def test_draft_accounting_every_step_and_aborts(tiny_model_dirs, small_drafts):
    path = tiny_model_dirs["LlamaForCausalLM"]
    llm = LLM(
        path,
        dtype="float32",
        num_kv_blocks=64,
        block_size=4,
        speculative_config=_draft_config(small_drafts["LlamaForCausalLM"]),
    )
    engine, core = llm.engine, llm.engine.core
    draft = core.drafter.draft_model
    for i, prompt in enumerate(_prompts(6)):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=60))
    held = 0
    for step in range(12):
        engine.step()
        draft.check(r.request_id for r in core.scheduler.running)  # raises on a disagreement
        held = max(held, draft.num_records)
        if step == 5:
            engine.abort_request(["r0", "r3"])
            assert not {"r0-0", "r3-0", "r0", "r3"} & set(draft._seqs)
    assert held > 0 and draft.kv.usage > 0
    engine.abort_request([f"r{i}" for i in range(6)])
    assert not engine.has_unfinished_requests()
    assert draft.num_records == 0 and draft.kv.usage == 0.0
    draft.check([])


def test_random_requests_draw_drafts_from_q(tiny_model_dirs):
    """A request at temperature > 0 gets drafts with q (the distribution each came from) on the
    request while they await verification, which the sampler verifies by rejection sampling; a
    seeded run repeats itself."""
    path = tiny_model_dirs["LlamaForCausalLM"]
    params = [SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=i, max_tokens=30) for i in range(3)]
    llm = LLM(path, dtype="float32", num_kv_blocks=512, speculative_config=_draft_config(path))
    engine, core = llm.engine, llm.engine.core
    for i, prompt in enumerate(_prompts(3)):
        engine.add_request(f"r{i}", prompt, params[i])
    seen = 0
    while engine.has_unfinished_requests():
        engine.step()
        for req in core.scheduler.running:
            if req.num_draft_tokens:
                q = core.drafter._records[req.request_id].probs
                assert q is not None and q.shape == (req.num_draft_tokens, engine.vocab_size)
                torch.testing.assert_close(q.sum(dim=-1), torch.ones(len(q)))
                drafts = req.token_ids[-req.num_draft_tokens :]
                assert all(q[i, t] > 0 for i, t in enumerate(drafts))
                assert (q > 0).sum(dim=-1).max() <= 20  # top-k applied
                seen += 1
    assert seen > 0
    # The target as its own draft: q equals the target's p, so rejection sampling (accept with
    # min(1, p/q)) keeps nearly every draft; a q without the request's temperature or filters would not.
    stats = engine.stats()
    assert stats.spec_num_accepted_tokens >= 0.95 * stats.spec_num_draft_tokens > 0
    first, _ = _run(path, _draft_config(path), _prompts(3), params)
    again, _ = _run(path, _draft_config(path), _prompts(3), params)
    assert first == again


def _copy_with_tokenizer_change(src: str, dst, change) -> str:
    shutil.copytree(src, dst)
    tok = dst / "tokenizer.json"
    data = json.loads(tok.read_text())
    change(data)
    tok.write_text(json.dumps(data))
    return str(dst)


def test_bad_drafts_are_clear_errors(tiny_model_dirs, small_drafts, tmp_path):
    path = tiny_model_dirs["LlamaForCausalLM"]
    other_vocab = build_random_model(
        tmp_path / "vocab",
        "LlamaForCausalLM",
        **{**_dims(path), "num_layers": 1, "vocab_size": 400},
        tie_word_embeddings=True,
        dtype=torch.float32,
    )
    with pytest.raises(ValueError, match=r"vocabulary size \(400\) differs from the target's \(384\)"):
        LLM(path, dtype="float32", speculative_config=_draft_config(other_vocab))

    def swap(data):  # the same size, two tokens' ids exchanged
        vocab = data["model"]["vocab"]
        a, b = list(vocab)[40:42]
        vocab[a], vocab[b] = vocab[b], vocab[a]

    swapped = _copy_with_tokenizer_change(small_drafts["LlamaForCausalLM"], tmp_path / "swapped", swap)
    with pytest.raises(ValueError, match="tokenizer differs from the target's"):
        LLM(path, dtype="float32", speculative_config=_draft_config(swapped))

    def special(data):
        data["added_tokens"][-1]["content"] = "<|other|>"

    renamed = _copy_with_tokenizer_change(small_drafts["LlamaForCausalLM"], tmp_path / "special", special)
    with pytest.raises(ValueError, match=r"tokenizer differs|special tokens"):
        LLM(path, dtype="float32", speculative_config=_draft_config(renamed))

    bf16 = build_random_model(
        tmp_path / "bf16",
        "LlamaForCausalLM",
        **{**_dims(path), "num_layers": 1},
        tie_word_embeddings=True,
        dtype=torch.bfloat16,
    )
    with pytest.raises(ValueError, match=r"dtype \(bfloat16\) differs from the target's \(float32\)"):
        LLM(path, speculative_config=_draft_config(bf16))
    with pytest.raises(ValueError, match="does not load"):
        LLM(path, dtype="float32", speculative_config=_draft_config(str(tmp_path / "missing")))


@pytest.mark.parametrize(
    "config,message",
    [
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
        (
            {"method": "draft_model", "model": "x", "num_speculative_tokens": 2, "prompt_lookup_min": 2},
            "'prompt_lookup_min'",
        ),
        ({"method": "draft_model", "model": "x", "num_speculative_tokens": 2, "draft_tp": 1}, "'draft_tp'"),
        ({"method": "ngram", "model": "x", "num_speculative_tokens": 2}, "unknown key(s) 'model'"),
        ({"method": "draft_model", "model": 3, "num_speculative_tokens": 2}, "model must be a path"),
    ],
)
def test_bad_configs(tiny_llama_dir, config, message):
    with pytest.raises(ValueError, match="speculative_config") as info:
        EngineArgs(model=tiny_llama_dir, speculative_config=config)
    assert message in str(info.value)


def test_bench_drafts(tiny_model_dirs, tmp_path):
    """bench/drafts.py: a truncated copy with all the target's layers is the target (every draft
    accepted); fewer layers and a random draft load and serve."""
    from pagoda.bench.drafts import draft_model

    target = shutil.copytree(tiny_model_dirs["Qwen2ForCausalLM"], tmp_path / "target")
    full = draft_model(str(target), _dims(str(target))["num_layers"], "truncated")
    _, llm = _on_off(str(target), full, _prompts(2), GREEDY)
    stats = llm.engine.stats()
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens > 0
    for weights in ("truncated", "random"):
        draft = draft_model(str(target), 1, weights)
        assert draft == draft_model(str(target), 1, weights)  # written once
        assert (
            json.loads((tmp_path / f"target-draft1-{weights}" / "config.json").read_text())[
                "num_hidden_layers"
            ]
            == 1
        )
        _on_off(str(target), draft, _prompts(2), GREEDY)
    with pytest.raises(ValueError, match=r"--draft-layers must be in 1\.\.2"):
        draft_model(str(target), 3, "truncated")


@pytest.mark.slow
def test_bench_offline_spec_workload_with_a_draft_model(tiny_model_dirs, tmp_path, capsys):
    from pagoda.entrypoints.cli import main

    target = shutil.copytree(tiny_model_dirs["LlamaForCausalLM"], tmp_path / "target")
    argv = ["bench", "offline", "--model", str(target), "--workload", "spec", "--dtype", "float32"]
    code = main([*argv, "--output-len", "24", "--input-len", "12", "--draft-layers", "1"])
    out = capsys.readouterr().out
    assert code == 0
    assert "outputs identical: True" in out and '"method": "draft_model"' in out
    assert "acceptance rate:" in out and "draft model forward passes:" in out


def test_serve_flag_and_the_draft_pool(tiny_llama_dir, small_drafts):
    """`pagoda serve --speculative-config` takes the draft model; its pool holds as many tokens as
    the target's (the same blocks), in the target's dtype."""
    from pagoda.entrypoints.cli import build_parser
    from pagoda.entrypoints.serve_cli import _engine_args

    text = json.dumps(
        {"method": "draft_model", "model": small_drafts["LlamaForCausalLM"], "num_speculative_tokens": 3}
    )
    args = build_parser().parse_args(["serve", tiny_llama_dir, "--speculative-config", text])
    engine_args = _engine_args(args, tiny_llama_dir)
    llm = LLM(**{**vars(engine_args), "dtype": "float32", "num_kv_blocks": 40})
    config = llm.engine.core.config
    assert config.speculative.model == small_drafts["LlamaForCausalLM"]
    assert config.draft_model.dtype == config.model.dtype and config.draft_model.device == config.model.device
    assert (config.draft_cache.num_blocks, config.draft_cache.block_size) == (40, config.cache.block_size)
    draft = llm.engine.core.drafter.draft_model
    assert draft.worker.kv_caches[0].shape == llm.engine.core.executor.worker.kv_caches[0].shape
    assert len(draft.worker.kv_caches) == 1  # the draft's layers


def test_a_full_draft_pool_drafts_less_and_stays_exact(tiny_model_dirs):
    """When the draft's pool cannot hold a request's tokens, that request gets no draft-model
    drafts for the step (its draft KV is released), and outputs stay the same."""
    from pagoda.cache.kv_manager import KVCacheManager

    path = tiny_model_dirs["LlamaForCausalLM"]
    off, _ = _run(path, None, _prompts(4), GREEDY, block_size=4)
    llm = LLM(path, dtype="float32", num_kv_blocks=512, block_size=4, speculative_config=_draft_config(path))
    draft = llm.engine.core.drafter.draft_model
    draft.kv = KVCacheManager(12, 4)  # room for 48 draft tokens: not all four requests at once
    outs = llm.generate(_prompts(4), GREEDY, use_tqdm=False)
    assert [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outs] == off
    stats = llm.engine.stats()
    assert 0 < stats.spec_num_draft_tokens == stats.spec_num_accepted_tokens
    assert draft.num_pool_full > 0
    assert draft.num_records == 0 and draft.kv.usage == 0.0
    draft.check([])


def test_catch_up_is_chunked_and_every_request_gets_its_drafts(tiny_model_dirs):
    """Draft passes of at most `max_tokens` tokens: four prompts prefilled in one target step catch
    up together over several passes, and each request still gets its K drafts that step."""
    path = tiny_model_dirs["LlamaForCausalLM"]
    llm = LLM(path, dtype="float32", num_kv_blocks=512, speculative_config=_draft_config(path))
    engine, core = llm.engine, llm.engine.core
    draft = core.drafter.draft_model
    draft.max_tokens = 8  # as max_num_batched_tokens=8 would make it, with the target unchunked
    params = SamplingParams(temperature=0, max_tokens=30)
    for i in range(4):
        engine.add_request(f"r{i}", [(7 * i + j) % 300 + 3 for j in range(30)], params)
    drafted = 0
    while engine.has_unfinished_requests():
        passes = draft.num_forward_passes
        engine.step()
        for req in core.scheduler.running:
            if req.max_tokens - req.num_output_tokens > 5:
                assert req.num_draft_tokens == 4, req
                drafted += 1
        assert draft.num_forward_passes - passes <= 4 + 4 * 30 // 8 + 1
    assert drafted > 0
    stats = engine.stats()
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens > 0
