"""RMSNorm, rotary and paged decode attention kernels on every variant: against the torch path
and fp64 references, and bit for bit across variants."""

from __future__ import annotations

import pytest
import torch

from kernel_variants import RUNNABLE, on_every_variant, requires_variants
from pagoda.kernels import cpu_ops
from pagoda.layers import RMSNorm, apply_rotary


def _norm(hidden: int, seed: int) -> RMSNorm:
    norm = RMSNorm(hidden, 1e-6, torch.bfloat16)
    norm.weight.copy_(torch.randn(hidden, generator=torch.Generator().manual_seed(seed)))
    return norm


@pytest.mark.parametrize("rows", [1, 7])
@pytest.mark.parametrize("hidden", [16, 64, 100])
def test_rms_norm_rounds_like_the_torch_path(variant: str, rows: int, hidden: int) -> None:
    g = torch.Generator().manual_seed(hidden)
    norm = _norm(hidden, hidden)
    x = (torch.randn(rows, 3, hidden, generator=g) * 4).bfloat16()
    residual = torch.randn(rows, 3, hidden, generator=g).bfloat16()
    out, summed = cpu_ops.add_rms_norm(x, residual, norm.weight, norm.eps)
    assert torch.equal(summed, residual + x)
    torch.testing.assert_close(out, norm._norm(residual + x), atol=0, rtol=2**-7)  # one bf16 ulp at most
    alone, same = cpu_ops.add_rms_norm(x[:, 0], None, norm.weight, norm.eps)
    assert same is not None and torch.equal(same, x[:, 0])
    torch.testing.assert_close(alone, norm._norm(x[:, 0]), atol=0, rtol=2**-7)


@pytest.mark.parametrize(("tokens", "heads", "head_dim"), [(1, 16, 64), (7, 3, 16), (5, 2, 80), (3, 2, 36)])
def test_rotary_in_place_equals_the_torch_expression(
    variant: str, tokens: int, heads: int, head_dim: int
) -> None:
    g = torch.Generator().manual_seed(head_dim)
    base = torch.randn(tokens, heads + 2, head_dim, generator=g).bfloat16()  # q/k heads, then others
    cos, sin = torch.randn(tokens, 1, head_dim, generator=g).bfloat16().chunk(2, dim=-1)
    expected = apply_rotary(base[:, :heads], cos, sin)
    rotated = base.clone()
    out = apply_rotary(rotated[:, :heads], cos, sin, inplace=True)
    assert out.data_ptr() == rotated.data_ptr()
    assert torch.equal(rotated[:, :heads], expected)
    assert torch.equal(rotated[:, heads:], base[:, heads:])  # the other heads are untouched


def _dense_decode(q, keys, values, scale, window):
    """fp64 attention of one query per sequence over its key/value rows (a list per sequence)."""
    out = []
    for b, (k, v) in enumerate(zip(keys, values, strict=True)):
        if window:
            k, v = k[-window:], v[-window:]
        group = q.shape[1] // k.shape[1]
        k = k.double().repeat_interleave(group, dim=1)
        v = v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,khd->hk", q[b].double(), k) * scale
        out.append(torch.einsum("hk,khd->hd", scores.softmax(-1), v))
    return torch.stack(out)


def _paged_case(heads, kv_heads, head_dim, block_size, lens=(1, 9, 33, 70), seed=0):
    g = torch.Generator().manual_seed(head_dim + block_size + seed)
    num_blocks = 128
    # Slots no sequence owns hold large garbage: only the block tables may lead to data.
    cache = (torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g) * 100).bfloat16()
    free = torch.randperm(num_blocks, generator=g).tolist()
    width = -(-max(lens) // block_size)
    tables = torch.zeros(len(lens), width + 2, dtype=torch.int32)
    keys, values = [], []
    for b, n in enumerate(lens):
        blocks = [free.pop() for _ in range(-(-n // block_size))]
        tables[b, : len(blocks)] = torch.tensor(blocks)
        k = torch.randn(n, kv_heads, head_dim, generator=g).bfloat16()
        v = torch.randn(n, kv_heads, head_dim, generator=g).bfloat16()
        for t in range(n):
            cache[0, blocks[t // block_size], t % block_size] = k[t]
            cache[1, blocks[t // block_size], t % block_size] = v[t]
        keys.append(k)
        values.append(v)
    q = torch.randn(len(lens), heads, head_dim, generator=g).bfloat16()
    return q, cache, tables, torch.tensor(lens, dtype=torch.int32), keys, values


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"), [(4, 4, 16), (14, 2, 64), (6, 1, 80), (8, 2, 128), (4, 2, 272)]
)
@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize("window", [None, 1, 7])
def test_paged_decode_attention_matches_dense(variant, heads, kv_heads, head_dim, block_size, window) -> None:
    q, cache, tables, seq_lens, keys, values = _paged_case(heads, kv_heads, head_dim, block_size)
    scale = head_dim**-0.5
    out = cpu_ops.paged_decode_attention(q, cache, tables, seq_lens, scale, window)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    expected = _dense_decode(q, keys, values, scale, window)
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2**-7)
    # A strided query (a view into a wider qkv row) gives the same result.
    wide = torch.zeros(q.shape[0], heads + 3, head_dim, dtype=torch.bfloat16)
    wide[:, :heads] = q
    assert torch.equal(
        cpu_ops.paged_decode_attention(wide[:, :heads], cache, tables, seq_lens, scale, window), out
    )


@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_paged_decode_attention_writes_the_new_keys_and_values(variant: str, block_size: int) -> None:
    q, cache, tables, seq_lens, keys, values = _paged_case(14, 2, 64, block_size)
    last = seq_lens.long() - 1
    slots = tables[torch.arange(len(keys)), last // block_size].long() * block_size + last % block_size
    new_k = torch.stack([k[-1] for k in keys])  # already in `cache`: compare against a garbage-filled copy
    new_v = torch.stack([v[-1] for v in values])
    expected = cpu_ops.paged_decode_attention(q, cache, tables, seq_lens, 0.125, None)
    stale = cache.clone()
    flat = stale.view(2, -1, 2, 64)
    flat[:, slots] = 7.0
    wide = torch.zeros(len(keys), 2 * 2 + 14, 64, dtype=torch.bfloat16)  # k and v as views into one row
    wide[:, 14:16], wide[:, 16:] = new_k, new_v
    out = cpu_ops.paged_decode_attention(
        q, stale, tables, seq_lens, 0.125, None, (wide[:, 14:16], wide[:, 16:], slots)
    )
    assert torch.equal(out, expected) and torch.equal(stale, cache)
    with pytest.raises(RuntimeError, match="is not the block table's slot"):
        cpu_ops.paged_decode_attention(q, stale, tables, seq_lens, 0.125, None, (new_k, new_v, slots + 1))


def test_paged_decode_attention_rejects_bad_tables(variant: str) -> None:
    cache = torch.zeros(2, 4, 2, 1, 16, dtype=torch.bfloat16)
    q = torch.zeros(1, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_ops.paged_decode_attention(
            q, cache, torch.tensor([[7]], dtype=torch.int32), torch.tensor([2], dtype=torch.int32), 1.0, None
        )
    with pytest.raises(RuntimeError, match="beyond its block table"):
        cpu_ops.paged_decode_attention(
            q, cache, torch.tensor([[0]], dtype=torch.int32), torch.tensor([3], dtype=torch.int32), 1.0, None
        )


@requires_variants
def test_variants_agree_bit_for_bit() -> None:
    # Same fp32 operations in the same order on every variant (horizontal sums use one fixed tree).
    g = torch.Generator().manual_seed(5)
    norm = _norm(100, 3)
    x = (torch.randn(5, 100, generator=g) * 4).bfloat16()
    residual = torch.randn(5, 100, generator=g).bfloat16()
    rot = torch.randn(6, 5, 80, generator=g).bfloat16()
    cos, sin = torch.randn(6, 1, 80, generator=g).bfloat16().chunk(2, dim=-1)
    cases = [_paged_case(14, 2, 64, 16, lens=(1, 17, 300)), _paged_case(6, 1, 272, 5, lens=(40, 3))]

    def run():
        rotated = rot.clone()
        cpu_ops.rotary_(rotated, cos, sin)
        outs = [*cpu_ops.add_rms_norm(x, residual, norm.weight, norm.eps), rotated]
        for q, cache, tables, seq_lens, _, _ in cases:
            for window in (None, 9):
                outs.append(cpu_ops.paged_decode_attention(q, cache, tables, seq_lens, 0.125, window))
        return outs

    results = on_every_variant(run)
    first = results[RUNNABLE[0]]
    for name, outs in results.items():
        for i, (a, e) in enumerate(zip(outs, first, strict=True)):
            assert torch.equal(a, e), f"output {i}: {name} differs from {RUNNABLE[0]}"
