#!/usr/bin/env python3
"""Single-stream decode under tensor parallelism (issue 19): per-token latency and the
all-reduce cost of one decode step, for each tensor-parallel size, on this machine.

Each size runs as its own group of spawned ranks (`pagoda.distributed.run_on_ranks`), each rank
pinned to `--threads-per-rank` cores of its own. A rank loads its shard of a random model with
Qwen2.5-0.5B's shape (bf16; built once, the same folder `pagoda bench offline` uses), prefills
`--context` tokens and decodes `--steps` tokens greedily through the paged KV cache (rank 0 picks
each token and broadcasts it, as in the engine). Then it times the collectives of one step alone:
an all-reduce of one token's hidden state, as every attention and MLP block (and the embedding)
does, and the gather of the logits. Medians over the timed steps, after `--warmup`.

Usage:

    python scripts/bench_tensor_parallel.py                    # sizes 1 and 2, one core per rank
    python scripts/bench_tensor_parallel.py --sizes 1 2 4 --threads-per-rank 1 --steps 64
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from pagoda.attention.metadata import AttentionMetadata
from pagoda.bench.offline import DEFAULT_SHAPE
from pagoda.distributed import ParallelGroup, run_on_ranks
from pagoda.models import load_model
from pagoda.models.weight_report import weight_report

NUM_BLOCKS, BLOCK_SIZE = 64, 16


def default_model() -> str:
    from pagoda.models.synthetic import build_random_model

    path = os.path.join(
        os.path.expanduser("~"), ".cache", "pagoda", "bench-models", "qwen2.5-0.5b-shape-v151936"
    )
    if not os.path.isfile(os.path.join(path, "config.json")):
        print(f"building a random model with Qwen2.5-0.5B's shape in {path} (once)")
        build_random_model(path, "Qwen2ForCausalLM", vocab_size=151936, dtype="bfloat16", **DEFAULT_SHAPE)
    return path


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _one_sequence(start: int, num_new: int) -> tuple[torch.Tensor, AttentionMetadata]:
    """Positions and metadata for `num_new` tokens of one sequence at `start` (blocks 0, 1, ...)."""
    end = start + num_new
    blocks = list(range(-(-end // BLOCK_SIZE)))
    metadata = AttentionMetadata(
        slot_mapping=torch.arange(start, end, dtype=torch.int64),
        block_tables=torch.tensor([blocks], dtype=torch.int32),
        seq_lens=torch.tensor([end], dtype=torch.int32),
        query_start_loc=torch.tensor([0, num_new], dtype=torch.int32),
        num_decodes=1 if num_new == 1 else 0,
        seq_lens_cpu=[end],
        query_start_loc_cpu=[0, num_new],
        block_size=BLOCK_SIZE,
    )
    return torch.arange(start, end, dtype=torch.int64), metadata


def bench_rank(group: ParallelGroup, path: str, context: int, steps: int, warmup: int) -> dict:
    model = load_model(path, torch.bfloat16, tp=group)
    model.bind_kv_cache(model.allocate_kv_caches(NUM_BLOCKS, BLOCK_SIZE))
    config = model.config
    token = torch.zeros(1, dtype=torch.int64)

    def step(ids: torch.Tensor, start: int) -> None:
        positions, metadata = _one_sequence(start, ids.numel())
        logits = model.compute_logits(model(ids, positions, metadata)[-1:])
        if logits is not None:
            token.copy_(logits[0].argmax().view(1))
        group.broadcast(token)  # rank 0 samples; every rank feeds the same token next

    with torch.inference_mode():
        step(torch.randint(0, config.vocab_size, (context,), generator=torch.Generator().manual_seed(0)), 0)
        times = []
        for i in range(warmup + steps):
            group.barrier()
            start = time.perf_counter()
            step(token.clone(), context + i)
            times.append(time.perf_counter() - start)
        hidden = torch.randn(1, config.hidden_size)
        all_reduce_ms = _median_ms(lambda: group.all_reduce(hidden), 200)
        local_vocab = model.lm_head.vocab_rows
        logits = torch.randn(1, local_vocab)
        gather_ms = _median_ms(lambda: group.gather(logits), 50)
    return {
        "token_ms": 1e3 * statistics.median(times[warmup:]),
        "all_reduce_ms": all_reduce_ms,
        "all_reduces_per_step": 2 * config.num_layers + 1,  # attention + MLP per layer, embedding
        "gather_ms": gather_ms,
        "weight_mib": weight_report(model).nbytes / 2**20,
        "threads": torch.get_num_threads(),
        "cores": sorted(os.sched_getaffinity(0)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="model folder (default: a random model with Qwen2.5-0.5B's shape)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--threads-per-rank", type=int, default=1)
    parser.add_argument("--context", type=int, default=128, help="prompt tokens before decoding")
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps")
    parser.add_argument("--warmup", type=int, default=4)
    args = parser.parse_args()
    if args.context + args.warmup + args.steps > NUM_BLOCKS * BLOCK_SIZE:
        parser.error(f"context + warmup + steps must fit {NUM_BLOCKS * BLOCK_SIZE} tokens")
    path = args.model or default_model()
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
    print(f"CPU: {cpu}; {len(os.sched_getaffinity(0))} cores; model {path}")
    results = {}
    for size in args.sizes:
        rank0 = run_on_ranks(
            bench_rank,
            size,
            (path, args.context, args.steps, args.warmup),
            threads_per_rank=args.threads_per_rank,
            timeout_s=1800,
        )[0]
        results[size] = rank0
        collective_ms = rank0["all_reduce_ms"] * rank0["all_reduces_per_step"] + rank0["gather_ms"]
        print(
            f"size {size}: {rank0['token_ms']:.1f} ms/token ({1e3 / rank0['token_ms']:.1f} tok/s), "
            f"rank 0 holds {rank0['weight_mib']:.0f} MiB of weights on cores {rank0['cores']}; "
            f"all-reduce of one hidden state {1e3 * rank0['all_reduce_ms']:.0f} us x "
            f"{rank0['all_reduces_per_step']} + logits gather {1e3 * rank0['gather_ms']:.0f} us = "
            f"{collective_ms:.2f} ms a step ({100 * collective_ms / rank0['token_ms']:.0f}% of it)"
        )
    if 1 in results:
        for size, r in results.items():
            if size != 1:
                print(f"speed-up of size {size} over size 1: {results[1]['token_ms'] / r['token_ms']:.2f}x")


if __name__ == "__main__":
    main()
