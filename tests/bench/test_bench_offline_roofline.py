"""`pagoda bench offline` reports the kernel variant and, for single-stream decode, the
memory-read roofline measured in the same run."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from kernel_variants import requires_variants
from pagoda.bench import offline
from pagoda.entrypoints.cli import main
from pagoda.kernels import build


def test_weight_bytes_count_every_linear_layer_and_the_head(tiny_model_dirs) -> None:
    for arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):  # untied head; tied head and explicit head_dim
        path = tiny_model_dirs[arch]
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        params = sum(m.weight.numel() for m in hf.modules() if isinstance(m, torch.nn.Linear))
        assert offline.weight_bytes_per_token(path, "bfloat16") == 2 * params
        assert offline.weight_bytes_per_token(path, "float32") == 4 * params


def test_single_stream_prints_the_roofline_and_the_variant(tiny_model_dirs, tmp_path, capsys) -> None:
    result = tmp_path / "single.json"
    argv = ["bench", "offline", "--model", tiny_model_dirs["Qwen2ForCausalLM"], "--workload", "single"]
    argv += [
        "--input-len",
        "8",
        "--output-len",
        "6",
        "--kv-cache-memory-gb",
        "0.01",
        "--result-file",
        str(result),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"kernel variant: {build.status().describe()}" in out
    assert "of the roofline" in out and "GB of weights per token" in out
    data = json.loads(result.read_text())
    assert data["kernel_variant"] == build.status().variant
    roofline = data["roofline"]
    assert roofline["weight_bytes_per_token"] == offline.weight_bytes_per_token(
        tiny_model_dirs["Qwen2ForCausalLM"], "bfloat16"
    )
    assert roofline["bandwidth"]["best_gb_s"] > 0 and roofline["tok_per_s"] > 0
    assert {"pagoda", "pagoda decode", "transformers"} <= set(roofline["fraction_reached"])


@requires_variants  # an x86-64 CPU with AVX2, where the cap means something
def test_baseline_capped_at_avx2_runs_in_its_own_interpreter(tiny_model_dirs, tmp_path, capsys) -> None:
    result = tmp_path / "batch.json"
    argv = ["bench", "offline", "--model", tiny_model_dirs["Qwen2ForCausalLM"], "--workload", "batch"]
    argv += ["--num-prompts", "2", "--input-len", "8", "--output-len", "4", "--kv-cache-memory-gb", "0.01"]
    argv += ["--baseline-isa", "avx2", "--result-file", str(result)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2" in out
    assert "torch's CPU capability in the subprocess: AVX2" in out
    rows = json.loads(result.read_text())["results"]
    assert [r["name"] for r in rows] == ["pagoda", "transformers (avx2)"]
    assert rows[1]["output_tok_per_s"] > 0


def test_baseline_isa_needs_the_transformers_baseline(tiny_model_dirs) -> None:
    argv = ["bench", "offline", "--model", tiny_model_dirs["Qwen2ForCausalLM"], "--workload", "batch"]
    with pytest.raises(SystemExit, match="--baseline-isa applies to --baseline transformers"):
        main([*argv, "--baseline", "none", "--baseline-isa", "avx2"])
