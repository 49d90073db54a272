"""The paged attention backend against a dense float64 reference."""

from __future__ import annotations

import pytest
import torch

from pagoda.attention import (
    AttentionBackend,
    TorchPagedAttention,
    available_attention_backends,
    get_attention_backend,
)

HEAD_DIM = 16


class DenseSequences:
    """Keeps every sequence's full K/V history to compute attention densely."""

    def __init__(self, num_kv_heads: int) -> None:
        self.num_kv_heads = num_kv_heads
        self.keys: dict[object, torch.Tensor] = {}
        self.values: dict[object, torch.Tensor] = {}

    def append(self, seq_id: object, k: torch.Tensor, v: torch.Tensor) -> None:
        empty = torch.empty(0, self.num_kv_heads, HEAD_DIM, dtype=k.dtype)
        self.keys[seq_id] = torch.cat([self.keys.get(seq_id, empty), k])
        self.values[seq_id] = torch.cat([self.values.get(seq_id, empty), v])

    def attend(self, seq_id: object, q: torch.Tensor, scale: float, window: int | None) -> torch.Tensor:
        """Queries are the sequence's last `len(q)` tokens."""
        keys, values = self.keys[seq_id].double(), self.values[seq_id].double()
        seq_len, group = keys.shape[0], q.shape[1] // self.num_kv_heads
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q.double(), keys) * scale
        query_pos = torch.arange(seq_len - q.shape[0], seq_len)[:, None]
        key_pos = torch.arange(seq_len)[None, :]
        visible = key_pos <= query_pos
        if window is not None:
            visible &= key_pos > query_pos - window
        scores = scores.masked_fill(~visible, float("-inf"))
        return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)


def run_steps(
    paged_harness,
    steps: list[list[tuple[str, int]]],
    num_heads: int,
    num_kv_heads: int,
    block_size: int,
    window: int | None = None,
    dtype: torch.dtype = torch.float32,
    num_decodes: list[int | None] | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Run each step through the paged backend and the dense reference; returns (paged, dense) pairs."""
    generator = torch.Generator().manual_seed(0)
    scale = HEAD_DIM**-0.5
    backend = TorchPagedAttention(num_heads, num_kv_heads, HEAD_DIM, scale, sliding_window=window)
    num_blocks = 64
    cache = TorchPagedAttention.allocate_kv_cache(
        num_blocks, block_size, num_kv_heads, HEAD_DIM, dtype, "cpu"
    )
    # Fill never-written slots with large finite garbage: only masking may hide them.
    cache.copy_(torch.randn(cache.shape, generator=generator) * 100)
    harness = paged_harness(num_blocks, block_size, seed=1)
    dense = DenseSequences(num_kv_heads)
    results = []
    for index, batch in enumerate(steps):
        step = harness.step(batch, num_decodes=None if num_decodes is None else num_decodes[index])
        total = sum(n for _, n in batch)
        q = torch.randn(total, num_heads, HEAD_DIM, generator=generator).to(dtype)
        k = torch.randn(total, num_kv_heads, HEAD_DIM, generator=generator).to(dtype)
        v = torch.randn(total, num_kv_heads, HEAD_DIM, generator=generator).to(dtype)
        out = backend.forward(q, k, v, cache, step.metadata)
        expected, start = [], 0
        for seq_id, num_new in batch:
            dense.append(seq_id, k[start : start + num_new], v[start : start + num_new])
            expected.append(dense.attend(seq_id, q[start : start + num_new], scale, window))
            start += num_new
        results.append((out, torch.cat(expected)))
    return results


MIXED_STEPS = [
    [("a", 9), ("b", 3), ("c", 14)],  # prefills of different lengths
    [("a", 1), ("b", 1), ("c", 5), ("d", 7)],  # decodes, then a chunk with context and a new prompt
    [("d", 1), ("a", 1), ("b", 1), ("c", 1)],  # decodes only
    [("b", 1), ("a", 6)],  # a decode and a chunk appended to a sequence that has been decoding
]


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_paged_matches_dense_reference(paged_harness, num_heads, num_kv_heads, block_size):
    for out, expected in run_steps(paged_harness, MIXED_STEPS, num_heads, num_kv_heads, block_size):
        assert out.shape == (expected.shape[0], num_heads, HEAD_DIM)
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [1, 3, 8])
def test_sliding_window_matches_dense_reference(paged_harness, window):
    for out, expected in run_steps(paged_harness, MIXED_STEPS, 4, 2, block_size=4, window=window):
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_one_token_prefill_equals_decode(paged_harness):
    """A single new token gives the same result on the decode path and on the prefill path."""
    steps = [[("a", 10), ("b", 7)], [("a", 1), ("b", 1)]]
    as_decodes = run_steps(paged_harness, steps, 4, 2, block_size=4, num_decodes=[None, 2])
    as_prefills = run_steps(paged_harness, steps, 4, 2, block_size=4, num_decodes=[None, 0])
    torch.testing.assert_close(as_decodes[1][0], as_prefills[1][0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(as_prefills[1][0].double(), as_prefills[1][1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_close_to_reference(paged_harness, dtype):
    for out, expected in run_steps(paged_harness, MIXED_STEPS, 8, 2, block_size=4, dtype=dtype):
        assert out.dtype == dtype
        torch.testing.assert_close(out.double(), expected, atol=3e-2, rtol=3e-2)


def test_write_kv_places_tokens_at_their_slots(paged_harness):
    backend = TorchPagedAttention(4, 2, HEAD_DIM, 0.25)
    cache = TorchPagedAttention.allocate_kv_cache(16, 4, 2, HEAD_DIM, torch.float32, "cpu")
    step = paged_harness(16, 4, seed=3).step([("a", 6), ("b", 9)])
    k = torch.randn(15, 2, HEAD_DIM)
    v = torch.randn(15, 2, HEAD_DIM)
    backend.write_kv(k, v, cache, step.metadata.slot_mapping)
    slots = step.metadata.slot_mapping
    assert len(set(slots.tolist())) == 15
    torch.testing.assert_close(cache[0].view(-1, 2, HEAD_DIM)[slots], k)
    torch.testing.assert_close(cache[1].view(-1, 2, HEAD_DIM)[slots], v)
    untouched = torch.ones(16 * 4, dtype=torch.bool)
    untouched[slots] = False
    assert cache.view(2, 16 * 4, -1)[:, untouched].abs().sum() == 0


def test_shuffled_blocks_are_not_contiguous(paged_harness):
    """Guard for the harness itself: the tests above really exercise scattered block tables."""
    step = paged_harness(64, 4, seed=1).step([("a", 16)])
    blocks = step.metadata.block_tables[0].tolist()
    assert blocks != sorted(blocks) and blocks != list(range(blocks[0], blocks[0] + 4))


def test_registry_and_cache_shape():
    assert "torch" in available_attention_backends()
    assert get_attention_backend("torch") is TorchPagedAttention
    assert issubclass(TorchPagedAttention, AttentionBackend)
    assert TorchPagedAttention.kv_cache_shape(10, 16, 2, 64) == (2, 10, 16, 2, 64)
    cache = TorchPagedAttention.allocate_kv_cache(3, 4, 2, 8, torch.bfloat16, "cpu")
    assert cache.shape == (2, 3, 4, 2, 8) and cache.dtype == torch.bfloat16 and not cache.any()
    with pytest.raises(ValueError, match=r"unknown attention backend 'flash'.*torch"):
        get_attention_backend("flash")


@pytest.mark.parametrize(
    "args,match",
    [
        ((6, 4, 16, 1.0), "multiple of num_kv_heads"),
        ((4, 0, 16, 1.0), "positive"),
        ((4, 2, 16, 1.0, 0), "sliding_window"),
    ],
)
def test_backend_rejects_bad_shapes(args, match):
    with pytest.raises(ValueError, match=match):
        TorchPagedAttention(*args)


def test_allocate_rejects_empty_cache():
    with pytest.raises(ValueError, match="num_blocks"):
        TorchPagedAttention.allocate_kv_cache(0, 16, 2, 8, torch.float32, "cpu")


def test_copy_blocks_copies_whole_blocks_in_both_k_and_v():
    cache = torch.randn(TorchPagedAttention.kv_cache_shape(8, 4, 2, HEAD_DIM))
    before = cache.clone()
    TorchPagedAttention.copy_blocks(cache, torch.tensor([1, 5]), torch.tensor([6, 2]))
    torch.testing.assert_close(cache[:, 6], before[:, 1], rtol=0, atol=0)
    torch.testing.assert_close(cache[:, 2], before[:, 5], rtol=0, atol=0)
    untouched = [0, 1, 3, 4, 5, 7]
    torch.testing.assert_close(cache[:, untouched], before[:, untouched], rtol=0, atol=0)


def test_long_bfloat16_prefill_matches_reference(paged_harness):
    """Long bf16 prefills may run in float32 on the CPU; the result must stay bf16 and correct."""
    steps = [[("a", 300)], [("b", 2), ("a", 260)]]
    for out, expected in run_steps(paged_harness, steps, 4, 2, block_size=16, dtype=torch.bfloat16):
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)


def test_bfloat16_short_runs_attend_natively_beside_long_ones(paged_harness, monkeypatch):
    """Decodes and verification-sized runs (up to NATIVE_MAX_QUERY_LEN new tokens) go to the
    native kernel in one call, the leading ones of the batch; longer runs, and short ones after
    them, through the PyTorch path. Every mix matches the reference."""
    from pagoda.attention import torch_paged
    from pagoda.kernels import cpu_ops

    calls = []
    native = cpu_ops.paged_attention
    monkeypatch.setattr(
        cpu_ops, "paged_attention", lambda q, *args: calls.append(q.shape[0]) or native(q, *args)
    )
    limit = torch_paged.NATIVE_MAX_QUERY_LEN
    steps = [
        [("a", 80), ("b", 20)],
        [("b", 9), ("a", limit + 5), ("c", 3)],
        [("c", 1), ("b", 1), ("a", limit)],
        [("c", 1), ("a", 9), ("b", limit + 1)],
    ]
    for out, expected in run_steps(paged_harness, steps, 8, 2, block_size=16, dtype=torch.bfloat16):
        torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)
    if cpu_ops.applies(torch.zeros(1, dtype=torch.bfloat16)):
        assert calls == [9, 2 + limit, 10]  # the first step leads with a long run: none
