"""Tensor parallelism against size 1 and transformers, as multi-process runs (gloo on the CPU),
and the distributed package's pieces: shard arithmetic, the shard hook, collectives, faults."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from distributed.tp_ranks import FORCED, PROMPTS, all_scenarios, fail_on_rank_one
from pagoda.distributed import (
    SINGLE,
    DistributedInitError,
    ParallelGroup,
    RankFailed,
    even_split,
    free_port,
    init_distributed,
    kv_head_shard,
    rank_cores,
    run_on_ranks,
    vocab_shard,
)
from pagoda.entrypoints.cli import main as cli_main
from pagoda.kernels import build
from pagoda.layers.sharding import LazyTensor, narrow
from pagoda.models import load_model
from pagoda.models.hf_config import parse_hf_config, read_hf_config
from pagoda.models.synthetic import build_random_model
from pagoda.quant.formats import GGMLType
from pagoda.quant.tensor import GGMLTensor
from tiny_models import TINY_DIMS, TINY_VARIANTS

# The four tiny architectures, a Llama with o_proj and MLP biases (row-parallel biases) and a
# Qwen2 whose vocabulary does not divide by the sizes (uneven vocab shards, padded gather).
ARCHS = [*TINY_VARIANTS, "llama-biases", "qwen2-odd-vocab"]
BF16_ARCH = "Qwen2ForCausalLM"
ATOL = 1e-4
_RUNS: dict[int, list[dict]] = {}


@pytest.fixture(scope="module")
def model_dirs(tiny_model_dirs, tmp_path_factory) -> dict[str, str]:
    biased = build_random_model(
        tmp_path_factory.mktemp("tp") / "llama-biases",
        "LlamaForCausalLM",
        **TINY_DIMS,
        tie_word_embeddings=False,
        dtype=torch.float32,
        seed=11,
        initializer_range=0.1,
        attention_bias=True,
        mlp_bias=True,
    )
    odd_vocab = build_random_model(
        tmp_path_factory.mktemp("tp") / "qwen2-odd-vocab",
        "Qwen2ForCausalLM",
        **{**TINY_DIMS, "vocab_size": 381},
        tie_word_embeddings=True,
        dtype=torch.float32,
        seed=12,
        initializer_range=0.1,
    )
    return {**tiny_model_dirs, "llama-biases": biased, "qwen2-odd-vocab": odd_vocab}


@pytest.fixture(scope="module")
def jobs(model_dirs, tmp_path_factory) -> dict[str, dict]:
    """The scenarios every size runs: each model in fp32; Qwen2 in bf16 (forced tokens); GGUF Q8_0
    files (Qwen2: biases, untied; Llama: q/k rows permuted, tied) and Mistral quantized at load."""
    out = tmp_path_factory.mktemp("tp_gguf")
    ggufs = {}
    for arch in ("Qwen2ForCausalLM", "LlamaForCausalLM"):
        ggufs[arch] = str(out / f"{arch}-q8_0.gguf")
        assert cli_main(["quantize", model_dirs[arch], ggufs[arch], "--type", "q8_0", "--quiet"]) == 0
    return {
        **{name: {"path": path} for name, path in model_dirs.items()},
        "bf16": {"path": model_dirs[BF16_ARCH], "dtype": torch.bfloat16, "forced": FORCED},
        **{f"gguf-{arch}": {"path": path, "forced": FORCED} for arch, path in ggufs.items()},
        "q8_0-at-load": {"path": model_dirs["MistralForCausalLM"], "quantization": "q8_0", "forced": FORCED},
    }


@pytest.fixture(scope="module")
def tp_run(jobs):
    """`tp_run(size)` → each rank's `all_scenarios(jobs)` at that size (size 1 in this process,
    larger sizes as one multi-process run, each started once)."""

    def run(size: int) -> list[dict]:
        if size not in _RUNS:
            if size == 1:
                _RUNS[1] = [all_scenarios(SINGLE, jobs)]
            else:
                _RUNS[size] = run_on_ranks(all_scenarios, size, (jobs,), timeout_s=300)
        return _RUNS[size]

    return run


def hf_greedy(path: str, prompt: list[int], count: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=count, do_sample=False, min_new_tokens=count
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("arch", ARCHS)
def test_tensor_parallel_matches_size_one_and_transformers(arch, size, tp_run, model_dirs):
    single, parallel = tp_run(1)[0]["scenarios"][arch], tp_run(size)[0]["scenarios"][arch]
    assert parallel["weights"] < single["weights"]  # rank 0 holds only its shard
    for seq, prompt in PROMPTS.items():
        (logits, tokens), (tp_logits, tp_tokens) = single[seq], parallel[seq]
        torch.testing.assert_close(tp_logits, logits, atol=ATOL, rtol=0)
        assert tp_tokens == tokens
        assert tokens == hf_greedy(model_dirs[arch], prompt, len(tokens))


@pytest.mark.parametrize("size", [2, 4])
def test_bf16_shards_run_the_cpu_kernels_close_to_size_one(size, tp_run):
    """bf16 weights are packed for the native kernels on each rank's shard (when they run); the
    all-reduce sums in float32, so logits agree with size 1 to bf16 rounding."""
    single, parallel = tp_run(1)[0]["scenarios"]["bf16"], tp_run(size)[0]["scenarios"]["bf16"]
    assert parallel["bf16_kernel"] == build.available()
    for seq in PROMPTS:
        logits, tp_logits = single[seq][0], parallel[seq][0]
        assert logits.dtype == torch.float32 and tp_logits.shape == logits.shape
        assert (tp_logits - logits).abs().max() < 0.05 * logits.abs().max()


@pytest.mark.parametrize("job", ["gguf-Qwen2ForCausalLM", "gguf-LlamaForCausalLM", "q8_0-at-load"])
def test_quantized_shards_match_size_one(job, tp_run):
    """Q8_0 weights split on whole blocks (rows always; o/down columns at 32-value blocks) and
    multiplied by the quantized kernels on each rank: the same blocks and the same products,
    summed in another order across ranks. The kernels round activations to 8 bits per block, so
    an fp32 difference in the last bit can move one activation by a rounding step: we allow 1% of
    the logits' range (a wrong shard moves them by their whole range)."""
    single, parallel = tp_run(1)[0]["scenarios"][job], tp_run(2)[0]["scenarios"][job]
    assert "error" not in single and "error" not in parallel, (single, parallel)
    assert parallel["weights"] < single["weights"]
    assert parallel["integer_kernel"] == build.available()
    for seq in PROMPTS:
        logits, tp_logits = single[seq][0], parallel[seq][0]
        assert (tp_logits - logits).abs().max() < 0.01 * logits.abs().max()


def test_a_quantized_split_off_block_boundaries_is_a_clear_error_at_load(tp_run):
    # At size 4 the o_proj input (4 heads x 16) splits into 16 columns: half a Q8_0 block.
    result = tp_run(4)[0]["scenarios"]["gguf-LlamaForCausalLM"]
    assert (
        "o_proj" in result["error"] and "does not fall on whole Q8_0 blocks of 32 values" in result["error"]
    )


def test_collectives_and_pinning(tp_run):
    ranks = [rank["collectives"] for rank in tp_run(2)]
    assert [r["all_reduce"] for r in ranks] == [[3.0] * 3] * 2
    assert [r["all_gather"] for r in ranks] == [[[0.0, 0.0, 1.0, 1.0]]] * 2
    assert ranks[0]["gather"] == [0.0, 0.0, 1.0, 1.0] and ranks[1]["gather"] is None
    assert [r["broadcast"] for r in ranks] == [[5.0, 5.0]] * 2
    assert [r["bf16_all_reduce"] for r in ranks] == [[2.0] * 4] * 2
    assert [r["object"] for r in ranks] == [{"step": 3, "ids": [1, 2]}] * 2
    for rank, result in enumerate(ranks):
        assert result["cores"] == rank_cores(rank, 2) and result["threads"] == len(result["cores"])


def test_a_failing_rank_fails_the_run_with_its_error():
    with pytest.raises(RankFailed, match=r"(?s)rank 1 failed.*rank one refuses"):
        run_on_ranks(fail_on_rank_one, 2, timeout_s=120)


def test_a_rank_that_never_joins_is_a_clear_error_within_the_timeout():
    start = time.monotonic()
    with pytest.raises(DistributedInitError, match=r"rank 0 of 2: .* did not form within 2 s"):
        init_distributed(0, 2, "127.0.0.1", free_port(), timeout_s=2)
    assert time.monotonic() - start < 30
    assert not dist.is_initialized()


def test_a_shape_that_cannot_be_split_is_a_clear_error_at_start(tiny_model_dirs):
    three = ParallelGroup(rank=0, size=3, group=object())  # never used: the check comes first
    with pytest.raises(
        ValueError, match=r"cannot be split over tensor_parallel_size=3: num_attention_heads \(4\)"
    ):
        load_model(tiny_model_dirs["LlamaForCausalLM"], torch.float32, tp=three)
    config = parse_hf_config(read_hf_config(tiny_model_dirs["LlamaForCausalLM"]))[1]
    with pytest.raises(ValueError, match=r"num_key_value_heads \(3; or the size a multiple of it\)"):
        replace(config, num_heads=12, num_kv_heads=3).check_tensor_parallel(4)
    with pytest.raises(ValueError, match=r"intermediate_size \(128\)"):
        replace(config, intermediate_size=128).check_tensor_parallel(256)


def test_shard_arithmetic():
    assert [even_split(12, r, 4, "x") for r in range(4)] == [(0, 3), (3, 3), (6, 3), (9, 3)]
    with pytest.raises(ValueError, match=r"x \(10\) is not divisible by the tensor-parallel size \(4\)"):
        even_split(10, 0, 4, "x")
    # Fewer KV heads than ranks: each head replicated on size / heads ranks, in rank order.
    assert [kv_head_shard(2, r, 4) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert [kv_head_shard(4, r, 2) for r in range(2)] == [(0, 2), (2, 2)]
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        kv_head_shard(3, 0, 4)
    # Any vocabulary splits: ceil(vocab / size) rows each, the last rank the rest.
    assert [vocab_shard(10, r, 4) for r in range(4)] == [(0, 3), (3, 3), (6, 3), (9, 1)]


def test_rank_cores_divide_the_available_cores():
    import os

    cores = sorted(os.sched_getaffinity(0))
    per = max(1, len(cores) // 2)
    assert rank_cores(0, 2) == cores[:per]
    assert rank_cores(0, 1, threads_per_rank=1) == cores[:1]
    assert len(rank_cores(1, 4)) == 1
    with pytest.raises(ValueError, match="threads_per_rank"):
        rank_cores(0, 2, threads_per_rank=0)


def test_shard_hook_reads_slices_of_safetensors_and_ggml_tensors(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    weight = torch.arange(8 * 64, dtype=torch.float32).reshape(8, 64)
    save_file({"w": weight}, str(tmp_path / "w.safetensors"))
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as f:
        lazy = LazyTensor(f.get_slice("w"))
        assert lazy.shape == (8, 64)
        torch.testing.assert_close(narrow(lazy, 0, 2, 3, "w"), weight[2:5])
        torch.testing.assert_close(narrow(lazy, 1, 32, 32, "w"), weight[:, 32:])
    q8 = GGMLTensor.quantize(torch.randn(8, 64), GGMLType.Q8_0)
    rows = narrow(q8, 0, 4, 4, "w")
    torch.testing.assert_close(rows.dequantize(), q8.dequantize()[4:])
    cols = narrow(q8, 1, 32, 32, "w")
    assert cols.shape == (8, 32)
    torch.testing.assert_close(cols.dequantize(), q8.dequantize()[:, 32:])
    with pytest.raises(ValueError, match="does not fall on whole Q8_0 blocks of 32 values"):
        narrow(q8, 1, 16, 16, "w")
