"""The pool of KV blocks: a free list and a reference count per block."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class OutOfBlocksError(RuntimeError):
    pass


class BlockPool:
    """A block is free iff its reference count is 0. Holders (requests, the prefix cache) own one
    reference each and give it back with `decref`."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocksError(f"asked for {n} KV blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self.ref_cnt[b] = 1
        return blocks

    def incref(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            self.ref_cnt[b] += 1

    def decref(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self._free.append(b)
            elif self.ref_cnt[b] < 0:
                raise RuntimeError(f"KV block {b} freed more often than it was referenced")

    def check(self) -> None:
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a KV block is on the free list twice")
        zero = {b for b, c in enumerate(self.ref_cnt) if c == 0}
        if free != zero:
            raise AssertionError(f"free list disagrees with ref counts: {sorted(free ^ zero)[:10]}")
        if any(c < 0 for c in self.ref_cnt):
            raise AssertionError("negative KV block reference count")
