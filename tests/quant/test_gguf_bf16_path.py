"""A BF16 GGUF file runs on the same kernels as the same weights in safetensors: every linear
layer, the LM head and the tied embedding packed for the bf16 GEMM (`pagoda.kernels.cpu_gemm`),
with the same bytes, and the decode plan binding the same ops; so their outputs are identical."""

from __future__ import annotations

import torch

from pagoda.entrypoints.llm import LLM
from pagoda.kernels import cpu_gemm
from pagoda.sampling_params import SamplingParams

PROMPTS = [[5, 17, 99, 3, 250, 41, 7], [300, 2, 8] * 9, [11]]


def _load(path: str) -> LLM:
    return LLM(path, dtype="bfloat16", num_kv_blocks=64, block_size=4, seed=0)


def _packed(llm: LLM) -> dict[str, cpu_gemm.PackedWeight]:
    model = llm.engine.core.executor.worker.model
    return {name: m.packed for name, m in model.named_modules() if getattr(m, "packed", None) is not None}


def test_bf16_gguf_takes_the_safetensors_kernel_path(variant, k_model_dir, k_gguf_file) -> None:
    folder, gguf = _load(k_model_dir), _load(k_gguf_file("bf16"))
    dense, from_file = _packed(folder), _packed(gguf)
    assert dense.keys() == from_file.keys()
    # Every linear layer (q/k/v, o, gate/up, down), the LM head and the embedding.
    assert any(name.endswith("lm_head") for name in dense)
    assert any(name.endswith("embed_tokens") for name in dense)
    assert sum(name.endswith("gate_up_proj") for name in dense) == 2
    for name, want in dense.items():
        got = from_file[name]
        assert isinstance(want, cpu_gemm.PackedWeight) and isinstance(got, cpu_gemm.PackedWeight), name
        assert got.data.dtype == want.data.dtype == torch.bfloat16, name
        shape = (got.out_features, got.in_features, got.swiglu)
        assert shape == (want.out_features, want.in_features, want.swiglu), name
        assert torch.equal(got.data, want.data), name
        assert (got.bias is None) == (want.bias is None), name
        if want.bias is not None:
            assert torch.equal(got.bias, want.bias), name
    for llm in (folder, gguf):
        model = llm.engine.core.executor.worker.model
        assert model.model.embed_tokens.packed is model.lm_head.packed  # tied: one packed copy
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=3, ignore_eos=True)
    runs = []
    for llm in (folder, gguf):
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        decoder = llm.engine.core.executor.worker.model.model
        assert decoder._decode_plan is not None  # decode steps ran the plan
        runs.append([(o.outputs[0].token_ids, [dict(s) for s in o.outputs[0].logprobs]) for o in outs])
    assert runs[0] == runs[1]
