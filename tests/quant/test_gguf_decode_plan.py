"""The decoder's flat decode loop (`pagoda.models.decode_plan`) runs GGUF models too, with each
quantized layer bound to its kernel op (`QuantLinear.kernel_arguments`), and computes what the module path
computes, bit for bit, on every kernel variant."""

from __future__ import annotations

import pytest

from pagoda.entrypoints.llm import LLM
from pagoda.models.decoder import DecoderModel
from pagoda.quant.linear import QuantLinear
from pagoda.sampling_params import SamplingParams

PROMPTS = [[5, 17, 99, 3, 250, 41, 7], [300, 2, 8] * 9, [11]]


def _generate(path: str, use_plan: bool, monkeypatch: pytest.MonkeyPatch):
    if not use_plan:
        monkeypatch.setattr(DecoderModel, "_plan_for", lambda self, hidden, md: None)
    try:
        llm = LLM(path, dtype="bfloat16", num_kv_blocks=64, block_size=4, seed=0)
        params = SamplingParams(max_tokens=10, temperature=0, logprobs=5, ignore_eos=True)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        monkeypatch.undo()
    runs = [
        (
            o.outputs[0].token_ids,
            [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs],
        )
        for o in outs
    ]
    return runs, llm.engine.core.executor.worker.model.model


@pytest.mark.parametrize("file_type", ["q8_0", "q4_0", "q4_k_m"])
def test_plan_runs_quantized_layers_as_the_modules_do(variant, file_type, k_gguf_file, monkeypatch) -> None:
    path = k_gguf_file(file_type)
    planned, decoder = _generate(path, True, monkeypatch)
    plan = decoder._decode_plan
    assert plan is not None  # the decode steps ran the plan
    layer = decoder.layers[0]
    assert isinstance(layer.mlp.gate_up_proj.packed, QuantLinear)
    assert plan.program.num_layers() == len(decoder.layers)  # every layer bound to its kernels
    modules, _ = _generate(path, False, monkeypatch)
    assert planned == modules
