"""Threads per rank: the cores this process may run on, divided among the ranks of this machine,
each rank pinned to its own cores (so ranks never compete for a core)."""

from __future__ import annotations

import os

import torch


def rank_cores(local_rank: int, local_size: int, threads_per_rank: int | None = None) -> list[int]:
    """The cores of local rank `local_rank` of `local_size`: `threads_per_rank` of them (default:
    the available cores divided among the ranks, at least one), taken in order; when there are
    fewer cores than ranks × threads, they wrap around and ranks share cores."""
    if not 0 <= local_rank < local_size:
        raise ValueError(f"local rank {local_rank} is not in 0..{local_size - 1}")
    if threads_per_rank is not None and threads_per_rank < 1:
        raise ValueError(f"threads_per_rank must be a positive integer, got {threads_per_rank}")
    cores = sorted(os.sched_getaffinity(0))
    per_rank = threads_per_rank or max(1, len(cores) // local_size)
    first = local_rank * per_rank
    return sorted({cores[(first + i) % len(cores)] for i in range(per_rank)})


def pin_rank(local_rank: int, local_size: int, threads_per_rank: int | None = None) -> list[int]:
    """Pin this process to its cores and size torch's thread pool to them; returns the cores.
    Call it before the first parallel torch operation (threads started earlier keep their cores)."""
    cores = rank_cores(local_rank, local_size, threads_per_rank)
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(threads_per_rank or len(cores))
    return cores
