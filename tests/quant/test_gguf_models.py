"""GGUF files end to end: written by `pagoda quantize`, loaded by pagoda (and by transformers),
compared with transformers on the original folder."""

from __future__ import annotations

import functools

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagoda import LLM, SamplingParams
from pagoda.config import EngineArgs
from pagoda.engine.resolve import resolve_dtype
from pagoda.kernels import build
from pagoda.models.gguf import llama_qk_rows, llama_qk_rows_inverse
from pagoda.models.loader import load_model
from pagoda.models.synthetic import build_random_model
from pagoda.models.weight_report import weight_report
from pagoda.quant.gguf_file import GGUFFile
from pagoda.quant.linear import QuantLinear
from pagoda.tokenizer import eos_token_ids, load_tokenizer
from tiny_models import TINY_DIMS

ARCHS = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
PROMPTS = [[5, 17, 99, 200, 3, 44, 300, 12], [7, 8, 9, 100, 150, 250, 33, 1, 2, 60, 61, 62, 63]]
MAX_NEW = 16
# Q8_0 against F32 (tiny random models, the worst case for quantization: no structure to keep):
# each weight is within half a step of 1/127 of its block's largest magnitude, which over two
# layers moves the logits by about 1% of their range; we allow 3%.
Q8_0_LOGIT_TOLERANCE = 0.03


@functools.cache
def hf_greedy(path: str, prompt: tuple[int, ...]) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=MAX_NEW,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def prompt_logits(path: str, paged_harness, prompt: list[int], **kwargs) -> torch.Tensor:
    model = load_model(path, torch.float32, **kwargs)
    model.bind_kv_cache(model.allocate_kv_caches(32, 16))
    step = paged_harness(32, 16).step([("p", len(prompt))])
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(prompt), step.positions, step.metadata))


@pytest.mark.parametrize("arch", ARCHS)
def test_f32_gguf_greedy_decodes_like_transformers(arch, gguf_file, tiny_model_dirs):
    path = gguf_file(arch, "f32")
    llm = LLM(model=path, dtype="auto", num_kv_blocks=64, block_size=4)
    assert llm.engine.config.model.dtype == torch.float32  # dtype auto: an all-F32 file runs in float32
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(tiny_model_dirs[arch], tuple(prompt))
    assert "GGUF ALL_F32" in llm.engine.weight_format


@pytest.mark.parametrize("arch", ARCHS)
def test_q8_0_prompt_logits_stay_close_to_f32(arch, gguf_file, paged_harness):
    prompt = PROMPTS[1]
    ref = prompt_logits(gguf_file(arch, "f32"), paged_harness, prompt)
    q8 = prompt_logits(gguf_file(arch, "q8_0"), paged_harness, prompt)
    spread = float(ref.max() - ref.min())
    assert float((q8 - ref).abs().max()) <= Q8_0_LOGIT_TOLERANCE * spread
    kl = F.kl_div(q8.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="batchmean")
    assert float(kl) < 1e-3


@pytest.mark.parametrize("file_type", ["q4_0", "q4_k_m", "q5_k_m", "q6_k", "bf16"])
def test_every_type_runs_and_stays_near_f32(file_type, k_gguf_file, paged_harness):
    """K-sized rows, so the files hold Q4_K / Q5_K / Q6_K themselves, not their fallbacks."""
    prompt = PROMPTS[0]
    ref = prompt_logits(k_gguf_file("f32"), paged_harness, prompt)
    path = k_gguf_file(file_type)
    got = prompt_logits(path, paged_harness, prompt)
    # KL budgets by bits per weight (random tiny models are the worst case; bf16 is near exact).
    budget = {"q4_0": 0.05, "q4_k_m": 0.03, "q5_k_m": 0.01, "q6_k": 0.005, "bf16": 1e-4}[file_type]
    kl = F.kl_div(got.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="batchmean")
    assert float(kl) < budget


def test_q4_k_m_mixture_as_llama_cpp_defines_it(k_gguf_file):
    f = GGUFFile(k_gguf_file("q4_k_m"))
    types = {name: f.tensor_type(name).name for name in f.tensor_names()}
    assert types["token_embd.weight"] == "Q6_K"  # tied: the output's type
    assert types["blk.0.attn_q.weight"] == "Q4_K"
    assert types["blk.0.ffn_gate.weight"] == "Q4_K"
    # use_more_bits(i, 2): layer 1 (>= 7 * 2 // 8) gets Q6_K attn_v and ffn_down, layer 0 not.
    assert types["blk.0.attn_v.weight"] == "Q4_K" and types["blk.1.attn_v.weight"] == "Q6_K"
    assert types["blk.0.ffn_down.weight"] == "Q4_K" and types["blk.1.ffn_down.weight"] == "Q6_K"
    assert types["blk.0.attn_norm.weight"] == "F32" and types["blk.0.attn_q.bias"] == "F32"
    assert f.get("general.file_type") == gguf.LlamaFileType.MOSTLY_Q4_K_M


def test_mixed_types_in_one_fused_layer(k_gguf_file):
    """q/k (Q4_K) and v (Q6_K) of layer 1 share one qkv projection: two segments."""
    model = load_model(k_gguf_file("q4_k_m"), torch.float32)
    qkv = model.model.layers[1].self_attn.qkv_proj.packed
    assert isinstance(qkv, QuantLinear)
    assert qkv.describe() == "Q4_K+Q6_K"
    assert model.model.layers[0].self_attn.qkv_proj.packed.describe() == "Q4_K"


@pytest.mark.parametrize("file_type", ["q8_0", "q4_k_m", "q4_0"])
def test_weights_stay_quantized_in_memory(file_type, k_gguf_file, k_model_dir):
    path = k_gguf_file(file_type)
    model = load_model(path, torch.bfloat16)
    resident = weight_report(model).nbytes
    file_bytes = GGUFFile(path).tensor_bytes
    # Quantized blocks as in the file; norms and biases in bf16 instead of F32 (a little less).
    assert 0.9 * file_bytes <= resident <= 1.05 * file_bytes
    dense = weight_report(load_model(k_model_dir, torch.bfloat16)).nbytes
    assert resident < {"q8_0": 0.6, "q4_k_m": 0.45, "q4_0": 0.4}[file_type] * dense


def test_transformers_loads_the_files_pagoda_writes(gguf_file, tiny_model_dirs, paged_harness):
    """transformers' own GGUF loader reads our F32 and Q8_0 files (Qwen2: its loader ignores
    Llama's attention biases and rope_freqs, and Qwen3's key_length, so those cannot be compared)."""
    arch = "Qwen2ForCausalLM"
    ids = torch.tensor([PROMPTS[1]])
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dirs[arch], dtype=torch.float32).eval()
    for file_type in ("f32", "q8_0"):
        path = gguf_file(arch, file_type)
        folder, name = path.rsplit("/", 1)
        hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
        with torch.inference_mode():
            got = hf(ids).logits[0]
        if file_type == "f32":
            assert torch.equal(got, original(ids).logits[0])
        # transformers dequantizes to float32 as pagoda's reference path does: the same logits.
        with build.use_variant(None):  # the reference path (no 8-bit activations)
            ours = prompt_logits(path, paged_harness, PROMPTS[1])
        torch.testing.assert_close(ours, got, rtol=1e-4, atol=1e-4)


def test_llama_rows_are_permuted_as_llama_cpp_does():
    rows = llama_qk_rows(8, 2)  # 2 heads of 4: [h0: 0 1 | 2 3] -> pairs (0, 2), (1, 3)
    assert rows.tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    assert llama_qk_rows(8, 2)[llama_qk_rows_inverse(8, 2)].tolist() == list(range(8))
    # The converter's own expression, on a weight.
    w = torch.arange(8 * 3).reshape(8, 3)
    converted = w.reshape(2, 2, 2, 3).swapaxes(1, 2).reshape(8, 3)
    assert torch.equal(w[rows], converted)


def test_llama_with_biases_decodes_like_transformers(tmp_path, quantize_to):
    folder = build_random_model(
        tmp_path / "llama-bias",
        "LlamaForCausalLM",
        **TINY_DIMS,
        tie_word_embeddings=False,
        dtype=torch.float32,
        attention_bias=True,
        mlp_bias=True,
        initializer_range=0.1,
    )
    path = quantize_to(folder, tmp_path / "llama-bias.gguf", "f32")
    llm = LLM(model=path, num_kv_blocks=32, block_size=4)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(folder, tuple(prompt))


def test_tokenizer_and_chat_template_come_from_the_file(gguf_file, tiny_model_dirs):
    arch = "Qwen2ForCausalLM"
    path = gguf_file(arch, "q8_0")
    ours, original = load_tokenizer(path), AutoTokenizer.from_pretrained(tiny_model_dirs[arch])
    for text in [
        "Hello world, this is the test.",
        "<|im_start|>user\nhi  there<|im_end|>\n",
        "ünï 12345 \n\n x",
    ]:
        assert ours.encode(text) == original.encode(text)
        assert ours.decode(ours.encode(text)) == text
    assert ours.chat_template == original.chat_template
    eos = eos_token_ids(ours, path)
    assert set(eos) == {
        original.convert_tokens_to_ids("<|endoftext|>"),
        original.convert_tokens_to_ids("<|im_end|>"),
    }
    # --tokenizer FOLDER uses the Hugging Face tokenizer instead; the end-of-generation ids stay the file's.
    llm = LLM(model=path, tokenizer=tiny_model_dirs[arch], num_kv_blocks=32)
    assert llm.tokenizer.encode("Hello world") == original.encode("Hello world")
    assert set(llm.engine.eos_token_ids) == set(eos)
    reply = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=4, temperature=0))
    assert len(reply[0].outputs[0].token_ids) <= 4


def test_dtype_auto_and_engine_arguments(gguf_file, tiny_model_dirs):
    assert resolve_dtype("auto", gguf_file("Qwen2ForCausalLM", "f32")) == torch.float32
    assert resolve_dtype("auto", gguf_file("Qwen2ForCausalLM", "q8_0")) == torch.bfloat16
    with pytest.raises(ValueError, match=r"GGUF file .* does not exist"):
        EngineArgs(model="missing.gguf")
    with pytest.raises(ValueError, match="quantization applies to safetensors"):
        EngineArgs(model=gguf_file("Qwen2ForCausalLM", "q8_0"), quantization="q8_0")
    with pytest.raises(ValueError, match="quantization must be one of q8_0, q4_0, q4_k"):
        EngineArgs(model=tiny_model_dirs["Qwen2ForCausalLM"], quantization="q3_k")


# ---- bad files ----------------------------------------------------------------------------------
def write_gguf(
    path, arch: str, metadata: dict, tensors: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]]
):
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        if isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_string(key, value)
    for name, (data, qtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_unsupported_architecture_type_and_missing_key_are_named(gguf_file, tmp_path):
    embd = (np.zeros((8, 32), np.float32), gguf.GGMLQuantizationType.F32)
    path = write_gguf(tmp_path / "gpt2.gguf", "gpt2", {}, {"token_embd.weight": embd})
    with pytest.raises(ValueError, match="holds a 'gpt2' model; pagoda runs llama, qwen2, qwen3"):
        load_model(path, torch.float32)
    path = write_gguf(tmp_path / "nokey.gguf", "llama", {"llama.block_count": 1}, {"token_embd.weight": embd})
    with pytest.raises(ValueError, match=r"has no metadata key 'llama\.embedding_length'"):
        load_model(path, torch.float32)
    # An IQ2_XXS tensor in an otherwise valid file: the error names the tensor and its type.
    good = GGUFFile(gguf_file("Qwen2ForCausalLM", "q8_0"))
    meta = {
        k: good.get(k)
        for k in good.metadata_keys()
        if k.startswith("qwen2.") and isinstance(good.get(k), int | float)
    }
    meta["qwen2.embedding_length"] = meta["qwen2.rope.dimension_count"] = 256
    meta["qwen2.attention.head_count"] = meta["qwen2.attention.head_count_kv"] = 1
    iq = np.zeros((384, 66), np.uint8)  # one IQ2_XXS block (66 bytes) per row of 256
    path = write_gguf(
        tmp_path / "iq.gguf", "qwen2", meta, {"token_embd.weight": (iq, gguf.GGMLQuantizationType.IQ2_XXS)}
    )
    with pytest.raises(ValueError, match=r"'token_embd\.weight' has tensor type IQ2_XXS"):
        load_model(path, torch.float32)
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="cannot read GGUF file"):
        load_model(str(tmp_path / "junk.gguf"), torch.float32)


def test_unknown_tensor_is_named(gguf_file, tmp_path):
    good = GGUFFile(gguf_file("Qwen2ForCausalLM", "f32"))
    meta = {
        k: good.get(k)
        for k in good.metadata_keys()
        if k.startswith("qwen2.") and isinstance(good.get(k), int | float)
    }
    tensors = {}
    for name in good.tensor_names():
        t = good.read(name)
        data = t.data.numpy() if hasattr(t, "qtype") else t.numpy()
        tensors[name] = (data, good.tensor_type(name))
    tensors["blk.0.mystery.weight"] = (np.zeros(4, np.float32), gguf.GGMLQuantizationType.F32)
    path = write_gguf(tmp_path / "extra.gguf", "qwen2", meta, tensors)
    with pytest.raises(ValueError, match=r"'blk\.0\.mystery\.weight' is not part of a qwen2 model"):
        load_model(path, torch.float32)
