"""The built-in demo model through pagoda: greedy output equals transformers'."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagoda import LLM, SamplingParams
from pagoda.assets import default_model_path

PROMPTS = ["The old man walked slowly", "In the beginning", "And the king said unto them"]


def test_pagoda_matches_transformers_on_the_demo_model() -> None:
    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()
    llm = LLM(path, dtype="float32", num_kv_blocks=256)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = torch.tensor([out.prompt_token_ids])
        with torch.inference_mode():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24)
        expected = ref[0, ids.shape[1] :].tolist()
        assert out.outputs[0].token_ids == expected, prompt
        assert out.outputs[0].text == tokenizer.decode(expected, skip_special_tokens=True)
    assert any(out.outputs[0].text.strip() for out in outs)
