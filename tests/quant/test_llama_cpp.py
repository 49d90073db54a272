"""Against llama.cpp itself, where it is installed: llama-cpp-python (`pip install -e '.[llama-cpp]'`)
loads pagoda's files and computes the same logits, its quantizer picks the same types and writes
the same blocks, and (with `PAGODA_LLAMA_CPP_CONVERTER` naming llama.cpp's `convert_hf_to_gguf.py`)
its converter writes the same F32 file that pagoda loads like transformers."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from pagoda.models.loader import load_model
from pagoda.quant.formats import block_size, type_size
from pagoda.quant.gguf_file import GGUFFile
from pagoda.quant.tensor import GGMLTensor

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")

ARCHS = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
PROMPT = [5, 17, 99, 200, 3, 44, 300, 12, 7, 8, 9, 100, 150, 250, 33, 1]
GGML_TYPE_F32 = 0


def pagoda_logits(path: str, paged_harness) -> torch.Tensor:
    model = load_model(path, torch.float32)
    model.bind_kv_cache(model.allocate_kv_caches(32, 16))
    step = paged_harness(32, 16).step([("p", len(PROMPT))])
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(PROMPT), step.positions, step.metadata))


def llama_cpp_logits(path: str) -> torch.Tensor:
    llm = llama_cpp.Llama(
        model_path=path,
        n_ctx=64,
        n_batch=64,
        logits_all=True,
        n_threads=2,
        type_k=GGML_TYPE_F32,  # an F32 KV cache, so that F32 files compare closely
        type_v=GGML_TYPE_F32,
        verbose=False,
    )
    try:
        llm.eval(PROMPT)
        return torch.tensor(np.array(llm.scores[: len(PROMPT)]))
    finally:
        llm.close()


@pytest.mark.parametrize("arch", ARCHS)
def test_llama_cpp_runs_pagoda_f32_files_like_pagoda(arch, gguf_file, paged_harness):
    path = gguf_file(arch, "f32")
    torch.testing.assert_close(llama_cpp_logits(path), pagoda_logits(path, paged_harness), rtol=0, atol=2e-4)


@pytest.mark.parametrize("file_type", ["q8_0", "q4_0", "q4_k_m", "q5_k_m", "q6_k"])
def test_llama_cpp_runs_pagoda_quantized_files(file_type, k_gguf_file, paged_harness):
    """llama.cpp multiplies with activations rounded to 8 bits (pagoda's reference path does not):
    the logits agree to the size of that rounding."""
    path = k_gguf_file(file_type)
    ours, theirs = pagoda_logits(path, paged_harness), llama_cpp_logits(path)
    spread = float(ours.max() - ours.min())
    assert float((ours - theirs).abs().max()) < 0.03 * spread
    assert float((ours.argmax(-1) == theirs.argmax(-1)).float().mean()) >= 0.85


@pytest.mark.parametrize(
    "file_type, ftype, min_equal_blocks",
    [("q8_0", 7, 1.0), ("q4_0", 2, 0.999), ("q6_k", 18, 0.95), ("q5_k_m", 17, 0.95), ("q4_k_m", 15, 0.95)],
)
def test_llama_quantize_agrees_with_pagoda_quantize(
    file_type, ftype, min_equal_blocks, k_gguf_file, tmp_path
):
    """llama-quantize (no importance matrix) on pagoda's F32 file: the same type for every tensor,
    and the same bytes for (nearly) every block. K-quants sum in float32 like the reference C
    loops, but a compiler may fuse those multiply-adds, which moves a rare near-tie."""
    out = tmp_path / f"llama-{file_type}.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = 2
    assert (
        llama_cpp.llama_model_quantize(k_gguf_file("f32").encode(), str(out).encode(), ctypes.byref(params))
        == 0
    )
    theirs, ours = GGUFFile(str(out)), GGUFFile(k_gguf_file(file_type))
    assert sorted(theirs.tensor_names()) == sorted(ours.tensor_names())
    for name in theirs.tensor_names():
        assert theirs.tensor_type(name) == ours.tensor_type(name), name
        a, b = theirs.read(name), ours.read(name)
        if isinstance(a, GGMLTensor):
            blocks = a.data.reshape(-1, type_size(a.qtype)), b.data.reshape(-1, type_size(b.qtype))
            equal = float((blocks[0] == blocks[1]).all(-1).float().mean())
            assert equal >= min_equal_blocks, f"{name}: {equal:.3f} of {a.qtype.name} blocks equal"
            # Where they differ, by about one quantization step of the block at most.
            diff = (a.dequantize() - b.dequantize()).abs().max()
            step = b.dequantize().abs().max() / (2 ** (8 * type_size(a.qtype) // block_size(a.qtype) - 1))
            assert float(diff) <= 4 * float(step) + 1e-6, name


# ---- llama.cpp's converter ------------------------------------------------------------------------
CONVERTER = os.environ.get("PAGODA_LLAMA_CPP_CONVERTER")
# Run the converter with one change: our tiny byte-level tokenizer has no pre-tokenizer hash it
# knows, so it is told that it is GPT-2's (which it is: a ByteLevel pre-tokenizer with GPT-2's regex).
_RUN_CONVERTER = """
import importlib.util, sys
path = sys.argv[1]
spec = importlib.util.spec_from_file_location("convert_hf_to_gguf", path)
module = importlib.util.module_from_spec(spec)
sys.modules["convert_hf_to_gguf"] = module
spec.loader.exec_module(module)
import conversion.base
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv = sys.argv[1:]
module.main()
"""


def convert_with_llama_cpp(model_dir: str, out: Path) -> str:
    root = Path(CONVERTER).parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root / "gguf-py"), str(root)]))
    cmd = [
        sys.executable,
        "-c",
        _RUN_CONVERTER,
        CONVERTER,
        model_dir,
        "--outfile",
        str(out),
        "--outtype",
        "f32",
    ]
    subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=600)
    return str(out)


@pytest.mark.skipif(
    not CONVERTER or not Path(CONVERTER).is_file(), reason="PAGODA_LLAMA_CPP_CONVERTER not set"
)
@pytest.mark.parametrize("arch", ARCHS)
def test_llama_cpp_converter_files_load_like_transformers(
    arch, tiny_model_dirs, gguf_file, tmp_path, paged_harness
):
    path = convert_with_llama_cpp(tiny_model_dirs[arch], tmp_path / f"{arch}.gguf")
    theirs, ours = GGUFFile(path), GGUFFile(gguf_file(arch, "f32"))
    assert sorted(theirs.tensor_names()) == sorted(ours.tensor_names())
    for name in theirs.tensor_names():  # pagoda quantize writes the very same tensors
        a, b = theirs.read(name), ours.read(name)
        assert torch.equal(a.data, b.data) if isinstance(a, GGMLTensor) else torch.equal(a, b), name
    got = pagoda_logits(path, paged_harness)
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dirs[arch], dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = original(torch.tensor([PROMPT])).logits[0]
    # Llama's rope factors are rounded to float32 in the file: a last-bit difference.
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    if arch in ("Qwen2ForCausalLM", "MistralForCausalLM"):
        # transformers' GGUF loader drops Llama's rope_freqs and Qwen3's head_dim; these it reads.
        hf = AutoModelForCausalLM.from_pretrained(
            str(tmp_path), gguf_file=f"{arch}.gguf", dtype=torch.float32
        )
        with torch.inference_mode():
            assert torch.equal(hf.eval()(torch.tensor([PROMPT])).logits[0], got)


def test_perplexity_of_a_gguf_file_agrees_with_llama_cpp(tmp_path, quantize_to):
    """The demo model as Q4_K_M, on the first chunks of the held-out text: pagoda's perplexity
    and llama.cpp's (same tokens, same chunks, llama-perplexity's scoring) within 1%."""
    from pagoda.assets import default_model_path
    from pagoda.bench.perplexity import chunks, measure, tokenize_text
    from pagoda.tokenizer import load_tokenizer

    path = quantize_to(default_model_path(), tmp_path / "demo-q4_k_m.gguf", "q4_k_m")
    text = (Path(default_model_path()).parent / "texts" / "web-heldout.txt").read_text(encoding="utf-8")
    ctx, n_chunks = 256, 4
    ours = measure(path, text, dtype="float32", ctx_size=ctx, max_chunks=n_chunks, log=lambda *_: None)
    tokens, bos = tokenize_text(load_tokenizer(path), text)
    llm = llama_cpp.Llama(
        model_path=path, n_ctx=ctx, n_batch=ctx, logits_all=True, n_threads=2, verbose=False
    )
    nll, count = 0.0, 0
    try:
        for chunk in chunks(tokens, ctx, bos, n_chunks):
            llm.reset()
            llm.eval(chunk)
            logp = torch.tensor(np.array(llm.scores[ctx // 2 : ctx - 1])).log_softmax(-1)
            targets = torch.tensor(chunk[ctx // 2 + 1 :])
            nll -= float(logp.gather(1, targets.unsqueeze(1)).sum())
            count += len(targets)
    finally:
        llm.close()
    assert count == ours.num_tokens
    theirs = float(np.exp(nll / count))
    assert abs(ours.perplexity / theirs - 1) < 0.01
