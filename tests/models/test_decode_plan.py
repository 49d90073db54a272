"""The decoder's flat decode loop (`pagoda.models.decode_plan`) computes what the module path
computes, bit for bit, on every kernel variant and architecture; it stays out of the way where
it does not apply."""

from __future__ import annotations

import pytest
import torch

from pagoda.entrypoints.llm import LLM
from pagoda.models.decoder import DecoderModel
from pagoda.models.synthetic import build_random_model
from pagoda.sampling_params import SamplingParams
from tiny_models import TINY_DIMS

PROMPTS = [[5, 17, 99, 3, 250, 41, 7], [300, 2, 8] * 9, [11]]


def _decoder(llm: LLM) -> DecoderModel:
    return llm.engine.core.executor.worker.model.model


def _generate(path: str, dtype: str, use_plan: bool, monkeypatch: pytest.MonkeyPatch):
    if not use_plan:
        monkeypatch.setattr(DecoderModel, "_plan_for", lambda self, hidden, md: None)
    try:
        llm = LLM(path, dtype=dtype, num_kv_blocks=64, block_size=4, seed=0)
        params = SamplingParams(max_tokens=12, temperature=0, logprobs=5, ignore_eos=True)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        monkeypatch.undo()
    runs = [(o.outputs[0].token_ids, [dict(step) for step in o.outputs[0].logprobs]) for o in outs]
    return runs, _decoder(llm)


def _same(a, b) -> None:
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(a, b, strict=True):
        assert tokens == ref_tokens
        for step, ref_step in zip(logprobs, ref_logprobs, strict=True):
            assert {t: lp.logprob for t, lp in step.items()} == {t: lp.logprob for t, lp in ref_step.items()}


@pytest.mark.parametrize(
    "arch", ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
)
def test_plan_equals_the_module_path(variant: str, arch: str, tiny_model_dirs, monkeypatch) -> None:
    path = tiny_model_dirs[arch]
    planned, decoder = _generate(path, "bfloat16", True, monkeypatch)
    assert decoder._decode_plan is not None  # the decode steps ran the plan
    modules, _ = _generate(path, "bfloat16", False, monkeypatch)
    _same(planned, modules)


def test_plan_honours_sliding_windows(variant: str, tmp_path, monkeypatch) -> None:

    path = build_random_model(
        tmp_path / "m",
        "MistralForCausalLM",
        **TINY_DIMS,
        tie_word_embeddings=False,
        dtype=torch.float32,
        sliding_window=5,
        initializer_range=0.1,
    )
    planned, decoder = _generate(path, "bfloat16", True, monkeypatch)
    assert decoder._decode_plan is not None
    assert decoder._decode_plan.sliding_windows[0] == 5
    modules, _ = _generate(path, "bfloat16", False, monkeypatch)
    _same(planned, modules)


def test_no_plan_for_float32(tiny_model_dirs, monkeypatch) -> None:
    _, decoder = _generate(tiny_model_dirs["Qwen2ForCausalLM"], "float32", True, monkeypatch)
    assert decoder._decode_plan is None and decoder._plan_variant is None


def test_plan_is_rebuilt_over_rebound_kv_caches(tiny_model_dirs) -> None:
    llm = LLM(tiny_model_dirs["Qwen2ForCausalLM"], dtype="bfloat16", num_kv_blocks=64, block_size=4, seed=0)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    first = llm.generate(PROMPTS, params, use_tqdm=False)
    worker = llm.engine.core.executor.worker
    decoder = _decoder(llm)
    if decoder._decode_plan is None:
        pytest.skip("no kernel variant here")
    fresh = [torch.zeros_like(kv) for kv in worker.kv_caches]
    worker.model.bind_kv_cache(fresh)  # the plan held the old caches
    assert decoder._decode_plan is None
    worker.kv_caches = fresh
    llm.engine.reset_prefix_cache()  # the cached prefixes were in the old caches
    again = llm.generate(PROMPTS, params, use_tqdm=False)
    assert decoder._decode_plan is not None
    assert all(
        kv is layer.self_attn.attn.kv_cache
        for kv, layer in zip(decoder._decode_plan.kv_caches, decoder.layers, strict=True)
    )
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]
