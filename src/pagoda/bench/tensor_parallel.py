"""`pagoda bench offline --workload tp`: single-stream greedy decode through the engine at
tensor-parallel size 1 and `--tensor-parallel-size` N (2 unless given), `--threads-per-rank`
threads per rank (1 unless given), each rank pinned to its own cores.

Both engines live side by side and run in alternating repeats (medians). The size-N engine's rank
0 pins this process, so the size-1 runs use the same cores and threads as rank 0. Reported: the
per-token latency (decode steps only) of each size, and, from rank 0's collective timers, the
all-reduces per step and their cost, the logits gather, and the broadcast of the step's batch.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict

REPEATS = 3


def run_tp(args, model: str, prompts: list[list[int]], output_len: int, engine_factory):
    """`engine_factory(**overrides)` makes an LLMEngine from the benchmark's engine flags."""
    from pagoda.bench.offline import RunResult, _warmup
    from pagoda.sampling_params import SamplingParams

    size = args.tensor_parallel_size if args.tensor_parallel_size > 1 else 2
    threads = args.threads_per_rank or 1
    if output_len < 2:
        raise SystemExit("pagoda bench offline: --workload tp needs --output-len >= 2 (decode steps)")
    parallel = engine_factory(tensor_parallel_size=size, threads_per_rank=threads)
    engines = {
        "size 1": engine_factory(tensor_parallel_size=1, threads_per_rank=None),
        f"size {size}": parallel,
    }
    for engine in engines.values():
        _warmup(engine)
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    token_ms: dict[str, list[float]] = {name: [] for name in engines}
    outputs: dict[str, list[list[int]]] = {}
    timing = parallel.core.executor.worker.tp.timing
    control = parallel.core.executor.ctrl.timing
    collectives = {
        "all_reduce_s": 0.0,
        "all_reduce_calls": 0,
        "gather_s": 0.0,
        "broadcast_s": 0.0,
        "steps": 0,
    }
    try:
        for _ in range(REPEATS):
            for name, engine in engines.items():
                before, ctrl_before = asdict(timing), asdict(control)
                ids = [engine.add_request(None, p, params) for p in prompts]
                engine.step()  # the prefill and first token
                start, steps = time.perf_counter(), 0
                done = {}
                while engine.has_unfinished_requests():
                    done.update({o.request_id: o for o in engine.step() if o.finished})
                    steps += 1
                token_ms[name].append(1e3 * (time.perf_counter() - start) / steps)
                outputs[name] = [done[i].outputs[0].token_ids for i in ids]
                engine.reset_prefix_cache()
                if engine is parallel:
                    after, ctrl_after = asdict(timing), asdict(control)
                    for key in ("all_reduce_s", "all_reduce_calls", "gather_s"):
                        collectives[key] += after[key] - before[key]
                    collectives["broadcast_s"] += ctrl_after["broadcast_s"] - ctrl_before["broadcast_s"]
                    # Prefill and warm-up steps count too: per-step figures divide by all steps.
                    collectives["steps"] += ctrl_after["broadcast_calls"] - ctrl_before["broadcast_calls"]
    finally:
        parallel.shutdown()
    if outputs["size 1"] != outputs[f"size {size}"]:
        print("warning: the greedy outputs differ between the sizes (bf16 sums in another order)")
    one, many = statistics.median(token_ms["size 1"]), statistics.median(token_ms[f"size {size}"])
    steps = max(collectives["steps"], 1)
    reduce_ms = 1e3 * collectives["all_reduce_s"] / steps
    per_call_us = 1e6 * collectives["all_reduce_s"] / max(collectives["all_reduce_calls"], 1)
    gather_ms, bcast_ms = 1e3 * collectives["gather_s"] / steps, 1e3 * collectives["broadcast_s"] / steps
    print(
        f"threads per rank: {threads}\n"
        f"per-token latency (decode, median of {REPEATS}): size 1 {one:.1f} ms, size {size} {many:.1f} ms "
        f"({one / many:.2f}x)\n"
        f"size {size}, rank 0, per step: {collectives['all_reduce_calls'] / steps:.0f} all-reduces, "
        f"{reduce_ms:.2f} ms ({per_call_us:.0f} us each); logits gather {gather_ms:.2f} ms; batch broadcast "
        f"{bcast_ms:.2f} ms; collectives {100 * (reduce_ms + gather_ms + bcast_ms) / many:.0f}% of a token"
    )
    out_tokens = len(prompts) * (output_len - 1)  # the decode steps timed
    return [
        RunResult(name, statistics.median(token_ms[name]) * (output_len - 1) / 1e3, out_tokens, 0, [])
        for name in engines
    ]
