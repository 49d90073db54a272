"""The engine under tensor parallelism: `LLM(tensor_parallel_size=N)` spawns N - 1 worker ranks,
broadcasts each step's ForwardBatch to them and samples on rank 0. Greedy fp32 outputs equal size 1
and transformers token for token, through chunked prefill, preemption and prefix-cache hits."""

from __future__ import annotations

import os
import random
import time

import pytest
import torch

from engine.test_engine import assert_clean, hf_greedy
from pagoda import LLM, SamplingParams
from pagoda.config import EngineArgs, ParallelConfig
from pagoda.engine.resolve import kv_bytes_per_block, resolve_engine_config
from pagoda.models.hf_config import parse_hf_config, read_hf_config
from pagoda.worker.executor import ExecutorError

ARCHS = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
MAX_NEW = 8
# 16 blocks of 4 tokens for 6 prompts of 10-26 tokens: requests are preempted; 8-token steps
# chunk every prompt; the prompts share two prefixes, and the second round finds them cached.
ENGINE = dict(dtype="float32", num_kv_blocks=16, block_size=4, max_num_batched_tokens=8, max_num_seqs=4)


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    shared = [[rng.randrange(3, 384) for _ in range(9)] for _ in range(2)]
    return [shared[i % 2] + [rng.randrange(3, 384) for _ in range(1 + 3 * i)] for i in range(6)]


def _run(llm: LLM) -> tuple[list[list[int]], dict]:
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    prompts = _prompts()
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    again = [o.outputs[0].token_ids for o in llm.generate(prompts[:2], params)]  # prefix hits
    assert again == first[:2]
    stats = llm.engine.stats()
    assert_clean(llm)
    return first, {"preemptions": stats.num_preemptions, "hits": stats.prefix_cache_hits}


@pytest.mark.parametrize("arch", ARCHS)
def test_sizes_two_and_four_match_size_one_and_transformers(tiny_model_dirs, arch):
    path = tiny_model_dirs[arch]
    single, stats = _run(LLM(path, **ENGINE))
    assert stats["preemptions"] > 0 and stats["hits"] > 0
    for prompt, tokens in zip(_prompts(), single, strict=True):
        assert tokens == hf_greedy(path, tuple(prompt), MAX_NEW)
    affinity, threads = os.sched_getaffinity(0), torch.get_num_threads()
    for size in (2, 4):  # size 4: the 2 KV heads replicated on two ranks each
        with LLM(path, tensor_parallel_size=size, **ENGINE) as llm:
            assert llm.engine.core.executor.worker.model.tp.size == size
            outputs, tp_stats = _run(llm)
        assert outputs == single, f"size {size}"
        assert tp_stats == stats  # the same schedule: rank 0's scheduler is the same
        # This process (rank 0) got its cores and threads back.
        assert os.sched_getaffinity(0) == affinity and torch.get_num_threads() == threads


def test_a_dead_rank_fails_the_step_and_another_engine_can_start(tiny_model_dirs):
    path = tiny_model_dirs["Qwen2ForCausalLM"]
    params = SamplingParams(temperature=0, max_tokens=4)
    llm = LLM(path, tensor_parallel_size=2, **ENGINE)
    executor = llm.engine.core.executor
    executor.procs[1].kill()
    executor.procs[1].join()
    with pytest.raises(ExecutorError, match=r"tensor-parallel rank 1 exited \(exit code -9\)"):
        llm.generate([[5, 6, 7]], params)
    start = time.monotonic()
    llm.shutdown()
    assert time.monotonic() - start < 10
    # Rank 0's own failure (the model raises): the step fails, shutdown stops the other rank.
    with LLM(path, tensor_parallel_size=2, **ENGINE) as llm:
        model = llm.engine.core.executor.worker.model

        def failing(*args, **kwargs):
            raise RuntimeError("injected fault")

        model.forward = failing
        with pytest.raises(RuntimeError, match="injected fault"):
            llm.generate([[5, 6, 7]], params)
    with LLM(path, tensor_parallel_size=2, **ENGINE) as llm:
        assert llm.generate([[5, 6, 7]], params)[0].outputs[0].token_ids


def test_kv_blocks_are_sized_from_each_ranks_kv_heads(tiny_model_dirs):
    path = tiny_model_dirs["LlamaForCausalLM"]  # 2 KV heads
    arch = parse_hf_config(read_hf_config(path))[1]
    one = kv_bytes_per_block(arch, 16, torch.float32)
    assert kv_bytes_per_block(arch, 16, torch.float32, 2) == one // 2
    assert kv_bytes_per_block(arch, 16, torch.float32, 4) == one // 2  # one head each, replicated
    blocks = {
        size: resolve_engine_config(
            EngineArgs(model=path, dtype="float32", kv_cache_memory_gb=0.01, tensor_parallel_size=size)
        ).cache.num_blocks
        for size in (1, 2)
    }
    assert blocks == {1: int(0.01 * 2**30) // one, 2: int(0.01 * 2**30) // (one // 2)}


def test_a_shape_that_cannot_be_split_fails_before_any_rank_starts(tiny_model_dirs):
    with pytest.raises(ValueError, match=r"cannot be split over tensor_parallel_size=3"):
        LLM(tiny_model_dirs["Qwen2ForCausalLM"], dtype="float32", tensor_parallel_size=3)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(tensor_parallel_size=0), "tensor_parallel_size must be a positive integer"),
        (dict(tensor_parallel_size=3, nnodes=2), r"must be a multiple of nnodes \(2\)"),
        (dict(tensor_parallel_size=2, nnodes=2, node_rank=2, headless=True), r"node_rank must be in 0..1"),
        (dict(tensor_parallel_size=2, nnodes=2, node_rank=1), "start it with --headless"),
        (dict(tensor_parallel_size=2, headless=True), "only a node with node_rank > 0 runs --headless"),
        (dict(threads_per_rank=0), "threads_per_rank must be a positive integer"),
        (dict(master_port=70000), "master_port must be a port number"),
        (dict(distributed_timeout=0), "distributed_timeout must be a positive number"),
        (dict(master_port=29500), "tensor_parallel_size is 1"),
    ],
)
def test_parallel_settings_are_validated(tiny_model_dirs, kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=tiny_model_dirs["Qwen2ForCausalLM"], **kwargs)


def test_threads_per_rank_pins_a_single_rank_too(tiny_model_dirs):
    affinity, threads = os.sched_getaffinity(0), torch.get_num_threads()
    with LLM(tiny_model_dirs["Qwen2ForCausalLM"], dtype="float32", num_kv_blocks=16, threads_per_rank=1):
        assert len(os.sched_getaffinity(0)) == 1 and torch.get_num_threads() == 1
    assert os.sched_getaffinity(0) == affinity and torch.get_num_threads() == threads


def test_a_headless_node_is_not_an_engine(tiny_model_dirs):
    args = dict(tensor_parallel_size=2, nnodes=2, node_rank=1, headless=True, master_port=29511)
    with pytest.raises(ValueError, match="a headless node runs only worker ranks"):
        LLM(tiny_model_dirs["Qwen2ForCausalLM"], **args)
    parallel = EngineArgs(model=tiny_model_dirs["Qwen2ForCausalLM"], **args).parallel_config()
    assert parallel == ParallelConfig(2, 2, 1, "127.0.0.1", 29511, None, True, 60.0)
    assert parallel.local_size == 1 and parallel.global_rank(0) == 1


def test_structured_output_jump_forward_seeds_and_drafts_under_tensor_parallelism(tiny_model_dirs):
    """Sampling, grammar masks, jump-forward, seeds and n-gram drafts stay on rank 0: size 2 gives
    exactly size 1's outputs, and the grammar-constrained ones validate."""
    import json

    import jsonschema

    from pagoda import StructuredOutputs

    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"}},
        "required": ["name", "ok"],
        "additionalProperties": False,
    }
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    params = [
        SamplingParams(temperature=0, max_tokens=60, structured_outputs=StructuredOutputs(json=schema)),
        SamplingParams(
            temperature=1.0, seed=7, max_tokens=60, structured_outputs=StructuredOutputs(json=schema)
        ),
        SamplingParams(temperature=0, max_tokens=24),
        SamplingParams(temperature=0.8, seed=3, max_tokens=24, n=2),
    ]
    prompts = ["record:", "another record:", [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6], [9, 8, 9, 8, 9, 8, 9]]
    path = tiny_model_dirs["LlamaForCausalLM"]
    kwargs = dict(dtype="float32", num_kv_blocks=256, block_size=8, speculative_config=spec)

    def run(llm: LLM) -> tuple[list[list[list[int]]], int, int]:
        outs = llm.generate(prompts, params)
        stats = llm.engine.stats()
        assert_clean(llm)
        for out in outs[:2]:
            jsonschema.validate(json.loads(out.outputs[0].text), schema)
        tokens = [[c.token_ids for c in o.outputs] for o in outs]
        return tokens, stats.jump_forward_drafts, stats.spec_num_draft_tokens

    single = run(LLM(path, **kwargs))
    assert single[1] > 0 and single[2] > 0  # jump-forward and n-gram drafts both ran
    with LLM(path, tensor_parallel_size=2, **kwargs) as llm:
        assert run(llm) == single


def test_draft_model_on_rank_zero(tiny_model_dirs):
    """The draft model runs on rank 0 only, unsharded, beside rank 0's shard of the target: size 2
    gives size 1's greedy outputs and drafts (the target as its own draft: all accepted)."""
    path = tiny_model_dirs["LlamaForCausalLM"]
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 4, "max_running": 8}
    kwargs = dict(dtype="float32", num_kv_blocks=256, block_size=8, speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=24)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6, 7], [9, 8, 9, 8, 9, 8, 9], [3, 4, 40, 41, 42]]

    def run(llm: LLM) -> tuple[list[list[int]], int, int]:
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        stats = llm.engine.stats()
        assert_clean(llm)
        draft = llm.engine.core.drafter.draft_model
        assert draft.worker.model.tp.size == 1 and draft.num_records == 0
        return outs, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens

    single = run(LLM(path, **kwargs))
    assert single[1] == single[2] > 0
    with LLM(path, tensor_parallel_size=2, **kwargs) as llm:
        assert llm.engine.core.executor.worker.model.tp.size == 2
        assert run(llm) == single
