"""What the tensor-parallel tests run on every rank (module-level, so spawned ranks import it)."""

from __future__ import annotations

import os

import torch

from pagoda.distributed import ParallelGroup
from pagoda.kernels import cpu_gemm, cpu_quant
from pagoda.layers.linear import LinearBase
from pagoda.models import load_model
from pagoda.models.weight_report import weight_report
from pagoda.quant.linear import QuantLinear
from tiny_models import PagedKVHarness

NUM_BLOCKS = 64
BLOCK_SIZE = 4
PROMPTS = {"a": [5, 91, 17, 240, 33, 8, 150, 77, 2, 301, 64, 19, 200], "b": [44, 3, 120, 9, 260, 71]}
DECODE_STEPS = 4


def greedy_scenario(
    group: ParallelGroup,
    path: str,
    dtype: torch.dtype = torch.float32,
    quantization: str | None = None,
    forced: dict[str, list[int]] | None = None,
) -> dict | None:
    """Prompt a in two chunks (the second batched with b's first decode), then both decode greedily
    through the paged KV cache; rank 0 picks each next token and broadcasts it (as rank 0 samples in
    the engine), or each next token comes from `forced`. Returns, on rank 0, each sequence's logits
    rows and its tokens."""
    model = load_model(path, dtype, quantization=quantization, tp=group)
    model.bind_kv_cache(model.allocate_kv_caches(NUM_BLOCKS, BLOCK_SIZE))
    harness = PagedKVHarness(NUM_BLOCKS, BLOCK_SIZE, seed=3)
    a, b = PROMPTS["a"], PROMPTS["b"]
    logits: dict[str, list[torch.Tensor]] = {"a": [], "b": []}
    tokens: dict[str, list[int]] = {"a": [], "b": []}

    def run(batch: list[tuple[str, list[int]]], sample: list[str]) -> None:
        step = harness.step([(seq, len(new)) for seq, new in batch])
        ids = torch.tensor([t for _, new in batch for t in new], dtype=torch.int64)
        with torch.inference_mode():
            out = model.compute_logits(model(ids, step.positions, step.metadata))
        picked = torch.zeros(len(sample), dtype=torch.int64)
        start = 0
        if out is not None:
            for seq, new in batch:
                logits[seq].append(out[start : start + len(new)])
                start += len(new)
            ends = {seq: sum(len(n) for _, n in batch[: i + 1]) - 1 for i, (seq, _) in enumerate(batch)}
            picked = torch.stack([out[ends[seq]].argmax() for seq in sample])
        if forced is not None:
            picked = torch.tensor([forced[seq][len(tokens[seq])] for seq in sample])
        group.broadcast(picked)
        for seq, token in zip(sample, picked.tolist(), strict=True):
            tokens[seq].append(token)

    run([("a", a[:8]), ("b", b)], ["b"])
    run([("b", tokens["b"][-1:]), ("a", a[8:])], ["b", "a"])
    for _ in range(DECODE_STEPS):
        run([("a", tokens["a"][-1:]), ("b", tokens["b"][-1:])], ["a", "b"])
    if not group.is_first:
        return None
    result = {seq: (torch.cat(rows), tokens[seq]) for seq, rows in logits.items()}
    result["weights"] = weight_report(model).nbytes  # this rank's share (quantized ones included)
    packed = [m.packed for m in model.modules() if isinstance(m, LinearBase)]
    result["bf16_kernel"] = any(isinstance(p, cpu_gemm.PackedWeight) for p in packed)
    result["integer_kernel"] = any(
        isinstance(p, QuantLinear) and any(isinstance(k, cpu_quant.PackedQuant) for k in p.parts)
        for p in packed
    )
    return result


FORCED = {"a": [7, 300, 12, 99, 150], "b": [250, 1, 64, 180, 33, 5]}


def all_scenarios(group: ParallelGroup, jobs: dict[str, dict]) -> dict:
    """`greedy_scenario(group, **job)` for each job (on rank 0: its result, or the ValueError
    loading raised, as `{"error": message}`); on every rank, `collectives`."""
    results = {}
    for name, job in jobs.items():
        try:
            results[name] = greedy_scenario(group, **job)
        except ValueError as err:  # raised while loading, on every rank alike
            results[name] = {"error": str(err)}
    return {"scenarios": results if group.is_first else None, "collectives": collectives(group)}


def collectives(group: ParallelGroup) -> dict:
    """Each collective on rank-dependent tensors, and this rank's cores and threads."""
    rank = float(group.rank)
    return {
        "all_reduce": group.all_reduce(torch.full((3,), rank + 1)).tolist(),
        "all_gather": group.all_gather(torch.full((1, 2), rank), dim=-1).tolist(),
        "gather": (lambda t: None if t is None else t.tolist())(group.gather(torch.full((2,), rank), dim=0)),
        "broadcast": group.broadcast(torch.full((2,), rank + 5)).tolist(),
        "bf16_all_reduce": group.all_reduce(torch.ones(4, dtype=torch.bfloat16)).float().tolist(),
        "object": group.broadcast_object({"step": 3, "ids": [1, 2]} if group.is_first else None),
        "cores": sorted(os.sched_getaffinity(0)),
        "threads": torch.get_num_threads(),
    }


def fail_on_rank_one(group: ParallelGroup) -> int:
    if group.rank == 1:
        raise ValueError("rank one refuses")
    return group.rank
