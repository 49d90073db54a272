"""`ForwardBatch.build`: the decode-only fast path gives the general path's batch."""

from __future__ import annotations

import random

import pytest
import torch

from pagoda.worker.batch import ForwardBatch


def _fields(batch: ForwardBatch) -> dict:
    out = {}
    for name, value in vars(batch).items():
        out[name] = (value.dtype, value.tolist()) if isinstance(value, torch.Tensor) else value
    return out


@pytest.mark.parametrize("num_seqs", [1, 2, 7])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_decode_fast_path_equals_the_general_path(num_seqs: int, block_size: int) -> None:
    rng = random.Random(num_seqs * 100 + block_size)
    chunks = []
    for _ in range(num_seqs):
        start = rng.randrange(0, 60)
        blocks = rng.sample(range(1, 500), -(-(start + 1) // block_size) + rng.randrange(0, 3))
        chunks.append(([rng.randrange(0, 32000)], start, blocks))
    rows = list(range(num_seqs))
    fast = ForwardBatch.build(chunks, block_size, rows, [(3, 4)])
    general = ForwardBatch._general(chunks, block_size, rows, [(3, 4)])
    assert _fields(fast) == _fields(general)
    assert fast.num_decodes == num_seqs


def test_mixed_batch_takes_the_general_path() -> None:
    chunks = [([5], 9, [2, 3, 6]), ([1, 2, 3], 0, [7])]
    batch = ForwardBatch.build(chunks, 4, [0, 3], [])
    assert batch.num_decodes == 1
    assert batch.positions.tolist() == [9, 0, 1, 2]
    assert batch.slot_mapping.tolist() == [6 * 4 + 1, 28, 29, 30]
    assert batch.query_start_loc == [0, 1, 4]
