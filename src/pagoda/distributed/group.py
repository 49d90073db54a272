"""`ParallelGroup`: one rank's view of a tensor-parallel group and the collectives layers use."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class CollectiveTiming:
    """Calls and seconds spent in this rank's collectives (what `pagoda bench offline --workload
    tp` reports per step); a perf_counter pair per call, nothing next to a collective's cost."""

    all_reduce_calls: int = 0
    all_reduce_s: float = 0.0
    gather_calls: int = 0
    gather_s: float = 0.0
    broadcast_calls: int = 0
    broadcast_s: float = 0.0


@dataclass(frozen=True)
class ParallelGroup:
    """`rank` of `size` ranks; `group` is the torch.distributed process group (None for size 1).

    Every rank of the group must call a collective, in the same order, with tensors of the same
    shape and dtype (the model forward guarantees that: every rank runs the same layers)."""

    rank: int
    size: int
    group: dist.ProcessGroup | None = None
    timing: CollectiveTiming = field(default_factory=CollectiveTiming, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is not in a group of size {self.size}")
        if self.size > 1 and self.group is None:
            raise ValueError(f"a group of size {self.size} needs a process group")

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place; returns it."""
        if self.size > 1:
            start = time.perf_counter()
            dist.all_reduce(tensor, group=self.group)
            self.timing.all_reduce_calls += 1
            self.timing.all_reduce_s += time.perf_counter() - start
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `tensor` (all the same shape) concatenated along `dim`, on every rank."""
        if self.size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def gather(self, tensor: torch.Tensor, dim: int = -1, dst: int = 0) -> torch.Tensor | None:
        """Every rank's `tensor` (all the same shape) concatenated along `dim` on rank `dst`;
        None on the other ranks."""
        if self.size == 1:
            return tensor
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.size)] if self.rank == dst else None
        start = time.perf_counter()
        dist.gather(tensor, parts, dst=dist.get_global_rank(self.group, dst), group=self.group)
        self.timing.gather_calls += 1
        self.timing.gather_s += time.perf_counter() - start
        return None if parts is None else torch.cat(parts, dim=dim)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """`tensor` from rank `src` into every rank's `tensor` (in place); returns it."""
        if self.size > 1:
            dist.broadcast(tensor, src=dist.get_global_rank(self.group, src), group=self.group)
        return tensor

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """A picklable object from rank `src` (pass it there; anything elsewhere) to every rank:
        how a step message can travel from the scheduling rank to the workers."""
        if self.size == 1:
            return obj
        box = [obj if self.rank == src else None]
        start = time.perf_counter()
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, src), group=self.group)
        self.timing.broadcast_calls += 1
        self.timing.broadcast_s += time.perf_counter() - start
        return box[0]

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier(group=self.group)


SINGLE = ParallelGroup(rank=0, size=1)
