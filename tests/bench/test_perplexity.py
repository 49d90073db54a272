"""`pagoda bench perplexity`: chunking as llama-perplexity, KL divergence and top-1 agreement."""

from __future__ import annotations

import json
import math

import pytest

from pagoda.bench.perplexity import chunks, measure
from pagoda.entrypoints.cli import main

TEXT = (
    " ".join(f"the {w} of the world is in the hello and that" for w in ("light", "word", "day", "way")) * 30
)


def test_chunks_score_second_halves_with_bos():
    tokens = list(range(10, 30))
    assert chunks(tokens, 8, None, None) == [list(range(10, 18)), list(range(18, 26))]
    assert chunks(tokens, 8, 1, 1) == [[1, *range(11, 18)]]


def test_a_model_against_itself(tiny_model_dirs):
    model = tiny_model_dirs["Qwen2ForCausalLM"]
    result = measure(
        model, TEXT, reference=model, dtype="float32", ctx_size=64, max_chunks=3, log=lambda *_: None
    )
    assert result.num_chunks == 3 and result.num_tokens == 3 * (64 - 32 - 1)
    assert result.perplexity == pytest.approx(result.reference_perplexity)
    assert result.kl_divergence == pytest.approx(0.0, abs=1e-9)
    assert result.top1_agreement == 1.0
    # A random model knows nothing: its perplexity is about its vocabulary's size, or worse.
    assert result.perplexity > 50


def test_command_writes_json_and_quantization_costs_little(tiny_model_dirs, tmp_path, capsys):
    model = tiny_model_dirs["LlamaForCausalLM"]
    text = tmp_path / "t.txt"
    text.write_text(TEXT, encoding="utf-8")
    out = tmp_path / "r.json"
    argv = ["bench", "perplexity", model, "--text", str(text), "--reference", model, "--quantization", "q8_0"]
    assert (
        main(
            [*argv, "--dtype", "float32", "--ctx-size", "64", "--max-chunks", "2", "--result-file", str(out)]
        )
        == 0
    )
    result = json.loads(out.read_text())
    assert {"perplexity", "kl_divergence", "top1_agreement", "num_tokens"} <= set(result)
    assert 0 < result["kl_divergence"] < 0.01 and result["top1_agreement"] > 0.9
    assert math.isclose(result["perplexity"], result["reference_perplexity"], rel_tol=0.05)
    assert "KL divergence" in capsys.readouterr().out


def test_bad_input_is_one_clear_error(tiny_model_dirs, tmp_path, capsys):
    model = tiny_model_dirs["LlamaForCausalLM"]
    short = tmp_path / "short.txt"
    short.write_text("hello", encoding="utf-8")
    assert main(["bench", "perplexity", model, "--text", str(short)]) == 2
    assert "fewer than one chunk" in capsys.readouterr().err
    assert main(["bench", "perplexity", model, "--text", str(tmp_path / "none.txt")]) == 2
    assert main(["bench", "perplexity", model, "--text", str(short), "--ctx-size", "2"]) == 2
    assert "--ctx-size must be >= 8" in capsys.readouterr().err
