"""Run one function on every rank of a fresh tensor-parallel group on this machine (spawned
processes, torchrun-style rendezvous on 127.0.0.1): for tests and benchmarks, and the way local
worker processes start.

Each rank pins itself to its cores (`pin_rank`), joins the group, calls `fn(group, *args)` and
sends back its (picklable) result. A rank that raises or dies fails the whole run with
`RankFailed` (the other ranks are stopped), within `timeout_s`."""

from __future__ import annotations

import multiprocessing as mp
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from pagoda.distributed.affinity import pin_rank
from pagoda.distributed.init import destroy_distributed, init_distributed


class RankFailed(RuntimeError):
    """A rank raised, died, or did not finish in time."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    args: Sequence[Any],
    threads_per_rank: int | None,
    init_timeout_s: float,
    results: mp.Queue,
) -> None:
    try:
        pin_rank(rank, world_size, threads_per_rank)
        group = init_distributed(rank, world_size, "127.0.0.1", port, timeout_s=init_timeout_s)
        try:
            # Plain pickle bytes: a tensor put as is travels as a shared-memory handle that dies
            # with this process.
            results.put((rank, True, pickle.dumps(fn(group, *args))))
        finally:
            destroy_distributed()
    except BaseException:  # reported to the parent, which fails the run
        results.put((rank, False, traceback.format_exc()))


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    *,
    threads_per_rank: int | None = None,
    timeout_s: float = 300.0,
    init_timeout_s: float = 60.0,
) -> list[Any]:
    """`[fn(group_of_rank_0, *args), fn(group_of_rank_1, *args), ...]`, each in its own process.
    `fn` must be importable by name (a module-level function)."""
    if world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size}")
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(fn, rank, world_size, port, tuple(args), threads_per_rank, init_timeout_s, results),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    got: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < world_size:
            try:
                rank, ok, value = results.get(timeout=0.2)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in got and p.exitcode not in (None, 0)]
                if dead:
                    raise RankFailed(f"rank {dead[0]} died (exit code {procs[dead[0]].exitcode})") from None
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(got))
                    raise RankFailed(f"ranks {missing} did not finish within {timeout_s:g} s") from None
                continue
            if not ok:
                raise RankFailed(f"rank {rank} failed:\n{value}")
            got[rank] = pickle.loads(value)
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        results.close()
    return [got[rank] for rank in range(world_size)]
