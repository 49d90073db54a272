"""`LLM(model=FOLDER, quantization=...)`, the `pagoda quantize` command and where the format shows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagoda import LLM, SamplingParams
from pagoda.entrypoints.cli import build_parser, main
from pagoda.entrypoints.quantize_cli import FILE_TYPE_CHOICES
from pagoda.kernels import cpu_gemm
from pagoda.models.loader import load_model
from pagoda.models.weight_report import weight_report
from pagoda.quant.formats import FILE_TYPES, LOAD_TIME_TYPES
from pagoda.quant.gguf_file import GGUFFile
from pagoda.quant.linear import QuantLinear

PROMPT = [5, 17, 99, 200, 3, 44, 300, 12, 7, 8, 9, 100]


def prompt_logits(model, paged_harness) -> torch.Tensor:
    model.bind_kv_cache(model.allocate_kv_caches(32, 16))
    step = paged_harness(32, 16).step([("p", len(PROMPT))])
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(PROMPT), step.positions, step.metadata))


@pytest.mark.parametrize("quantization, budget", [("q8_0", 1e-3), ("q4_0", 0.05), ("q4_k", 0.05)])
def test_quantization_at_load(quantization, budget, k_model_dir, paged_harness):
    ref = prompt_logits(load_model(k_model_dir, torch.float32), paged_harness)
    model = load_model(k_model_dir, torch.float32, quantization=quantization)
    linears = {
        id(m.packed): m.packed for m in model.modules() if isinstance(getattr(m, "packed", None), QuantLinear)
    }
    linears = list(linears.values())
    assert len(linears) == 2 * 4 + 1  # qkv, o, gate_up, down per layer, and the head the embedding shares
    assert {layer.describe() for layer in linears} == {LOAD_TIME_TYPES[quantization].name}
    got = prompt_logits(model, paged_harness)
    kl = F.kl_div(got.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="batchmean")
    assert float(kl) < budget
    assert "quantized to " + quantization in model.weight_format


def test_quantization_at_load_through_the_engine(tiny_model_dirs):
    llm = LLM(
        model=tiny_model_dirs["LlamaForCausalLM"], quantization="q8_0", dtype="bfloat16", num_kv_blocks=32
    )
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 5
    assert "Q8_0 100%" in llm.engine.weight_format


def test_rows_that_fit_no_block_stay_dense(tmp_path, paged_harness):
    from pagoda.models.synthetic import build_random_model

    folder = build_random_model(
        tmp_path / "odd",
        "Qwen2ForCausalLM",
        hidden_size=64,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=100,  # down_proj rows of 100: no block type fits
        vocab_size=384,
        tie_word_embeddings=False,
        dtype=torch.float32,
    )
    model = load_model(folder, torch.float32, quantization="q4_k")
    mlp = model.model.layers[0].mlp
    # The dense fallback is the float weight (packed for the fp32 kernel where it runs).
    dense = mlp.down_proj.packed
    if dense is None:
        assert mlp.down_proj.weight is not None
    else:
        assert isinstance(dense, cpu_gemm.PackedWeight) and dense.dtype == torch.float32
    assert mlp.gate_up_proj.packed.describe() == "Q5_0"  # Q4_K falls back as llama.cpp's does
    assert model.model.embed_tokens.quantized is not None  # the untied embedding is quantized too
    report = weight_report(model)
    assert set(report.type_shares) == {"Q5_0", "F32"}


def test_quantize_command(tiny_model_dirs, tmp_path, capsys):
    assert set(FILE_TYPE_CHOICES) == set(FILE_TYPES)
    out = tmp_path / "m.gguf"
    assert (
        main(["quantize", tiny_model_dirs["Qwen3ForCausalLM"], str(out), "--type", "q4_k_m", "--quiet"]) == 0
    )
    assert "wrote" in capsys.readouterr().out
    assert GGUFFile(out).architecture == "qwen3" and not (tmp_path / "m.gguf.part").exists()
    # An existing file is kept unless --force; errors are one line and leave no file behind.
    assert main(["quantize", tiny_model_dirs["Qwen3ForCausalLM"], str(out), "--quiet"]) == 2
    assert "--force" in capsys.readouterr().err
    assert main(["quantize", str(tmp_path / "nowhere"), str(tmp_path / "x.gguf"), "--quiet"]) == 2
    assert "does not exist" in capsys.readouterr().err and not (tmp_path / "x.gguf").exists()
    assert main(["quantize", tiny_model_dirs["Qwen3ForCausalLM"], str(tmp_path / "x.bin")]) == 2
    with pytest.raises(SystemExit):
        build_parser().parse_args(["quantize", "a", "b.gguf", "--type", "q3_k"])


def test_generate_command_runs_a_gguf_file(gguf_file, capsys):
    path = gguf_file("Qwen2ForCausalLM", "q8_0")
    assert (
        main(["generate", path, "Hello", "--max-tokens", "3", "--temperature", "0", "--num-kv-blocks", "16"])
        == 0
    )
    with pytest.raises(SystemExit) as exc:
        main(["generate", path, "Hi", "--quantization", "q8_0"])
    assert exc.value.code == 2 and "keeps its own types" in capsys.readouterr().err
