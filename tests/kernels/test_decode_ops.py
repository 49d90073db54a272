"""RMSNorm, rotary and paged attention (decodes and several query rows per sequence) kernels on
every variant: against the torch path and fp64 references, and bit for bit across variants."""

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


def _dense(q, keys, values, query_lens, scale, window):
    """fp64 attention: sequence b's `query_lens[b]` query rows (its last positions, in order in
    `q`) over its key/value rows (a list per sequence), causal, with an optional window."""
    out, row = [], 0
    for k, v, rows in zip(keys, values, query_lens, strict=True):
        n = k.shape[0]
        group = q.shape[1] // k.shape[1]
        k = k.double().repeat_interleave(group, dim=1)
        v = v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[row : row + rows].double(), k) * scale
        query_pos = torch.arange(n - rows, n)[:, None]
        key_pos = torch.arange(n)[None, :]
        visible = key_pos <= query_pos
        if window:
            visible &= key_pos > query_pos - window
        scores = scores.masked_fill(~visible, float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
        row += rows
    return torch.cat(out)


def _paged_case(
    heads, kv_heads, head_dim, block_size, lens=(1, 9, 33, 70), query_lens=None, seed=0, dtype=torch.bfloat16
):
    """Sequences of `lens` tokens in a garbage-filled paged cache of `dtype`, with `query_lens`
    (default one each) query rows at their last positions; returns (q, cache, tables, seq_lens,
    query_start_loc, keys, values)."""
    query_lens = query_lens or [1] * len(lens)
    g = torch.Generator().manual_seed(head_dim + block_size + seed)
    num_blocks = sum(-(-n // block_size) for n in lens) + 32
    # Slots no sequence owns hold large garbage: only the block tables may lead to data.
    cache = (torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g) * 100).to(dtype)
    free = torch.randperm(num_blocks, generator=g).tolist()
    width = -(-max(lens) // block_size)
    tables = torch.zeros(len(lens), width + 2, dtype=torch.int32)
    keys, values = [], []
    for b, n in enumerate(lens):
        blocks = [free.pop() for _ in range(-(-n // block_size))]
        tables[b, : len(blocks)] = torch.tensor(blocks)
        k = torch.randn(n, kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(n, kv_heads, head_dim, generator=g).to(dtype)
        for t in range(n):
            cache[0, blocks[t // block_size], t % block_size] = k[t]
            cache[1, blocks[t // block_size], t % block_size] = v[t]
        keys.append(k)
        values.append(v)
    q = torch.randn(sum(query_lens), heads, head_dim, generator=g).to(dtype)
    starts = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return q, cache, tables, torch.tensor(lens, dtype=torch.int32), starts, keys, values


def _new_slots(tables, seq_lens, starts, block_size):
    """int64 cache slots of every query row (the sequences' last positions)."""
    slots = []
    for b in range(len(seq_lens)):
        rows = int(starts[b + 1] - starts[b])
        for pos in range(int(seq_lens[b]) - rows, int(seq_lens[b])):
            slots.append(int(tables[b, pos // block_size]) * block_size + pos % block_size)
    return torch.tensor(slots, dtype=torch.int64)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"), [(4, 4, 16), (14, 2, 64), (6, 1, 80), (8, 2, 128), (4, 2, 272)]
)
@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize("window", [None, 1, 7])
def test_paged_decode_attention_matches_dense(variant, heads, kv_heads, head_dim, block_size, window) -> None:
    q, cache, tables, seq_lens, starts, keys, values = _paged_case(heads, kv_heads, head_dim, block_size)
    scale = head_dim**-0.5
    out = cpu_ops.paged_attention(q, cache, tables, seq_lens, starts, scale, window)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    expected = _dense(q, keys, values, [1] * len(keys), scale, window)
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2**-7)
    # A strided query (a view into a wider qkv row) gives the same result.
    wide = torch.zeros(q.shape[0], heads + 3, head_dim, dtype=torch.bfloat16)
    wide[:, :heads] = q
    assert torch.equal(
        cpu_ops.paged_attention(wide[:, :heads], cache, tables, seq_lens, starts, scale, window), out
    )


# (lens, query rows): verification steps of k + 1 rows beside decodes, a sequence whose rows are
# all its tokens, and runs longer than one tile of rows (64 / heads-per-KV-head).
MULTI_ROW = [
    ((12, 40, 9, 70), (9, 1, 9, 3)),
    ((5, 77, 130), (5, 66, 2)),
]


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(8, 2, 32), (14, 2, 64), (6, 1, 80), (4, 4, 16)])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("window", [None, 1, 7])
@pytest.mark.parametrize(("lens", "query_lens"), MULTI_ROW)
def test_paged_attention_of_several_rows_matches_dense(
    variant, heads, kv_heads, head_dim, block_size, window, lens, query_lens
) -> None:
    q, cache, tables, seq_lens, starts, keys, values = _paged_case(
        heads, kv_heads, head_dim, block_size, lens, query_lens
    )
    scale = head_dim**-0.5
    out = cpu_ops.paged_attention(q, cache, tables, seq_lens, starts, scale, window)
    expected = _dense(q, keys, values, query_lens, scale, window)
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2**-7)


# Register tiles of the multi-row path: score rows (query rows x heads per KV head) that fill
# several tiles and leave odd remainders (1, 4 and 8 heads per KV head; 3, 5, 13, 37 and 70 rows),
# head_dim 64 and 128 (and an odd 72), contexts that end inside a position block or on one.
TILE_SHAPES = [
    ((1056, 70), (37, 5)),
    ((64, 33, 160), (13, 3, 64)),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("heads", "kv_heads"), [(2, 2), (8, 2), (8, 1)])
@pytest.mark.parametrize("head_dim", [64, 128, 72])
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize(("lens", "query_lens"), TILE_SHAPES)
def test_paged_attention_tile_shapes_match_dense(
    variant, dtype, heads, kv_heads, head_dim, window, lens, query_lens
) -> None:
    q, cache, tables, seq_lens, starts, keys, values = _paged_case(
        heads, kv_heads, head_dim, 16, lens, query_lens, dtype=dtype
    )
    scale = head_dim**-0.5
    out = cpu_ops.paged_attention(q, cache, tables, seq_lens, starts, scale, window)
    expected = _dense(q, keys, values, query_lens, scale, window)
    if dtype == torch.bfloat16:
        torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2**-7)
    else:
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(14, 2, 64), (8, 8, 128), (8, 1, 72)])
@pytest.mark.parametrize("block_size", [1, 16])
def test_verification_rows_equal_their_decodes_bit_for_bit(
    variant, dtype, heads, kv_heads, head_dim, block_size
) -> None:
    """Without a window, each of k + 1 query rows gives the bits a one-row decode at its position
    gives (speculation on and off see the same attention), whatever tile the rows fall in."""
    lens, query_lens = (40, 23), (9, 5)
    q, cache, tables, seq_lens, starts, _, _ = _paged_case(
        heads, kv_heads, head_dim, block_size, lens, query_lens, dtype=dtype
    )
    together = cpu_ops.paged_attention(q, cache, tables, seq_lens, starts, 0.125, None)
    row = 0
    for b, rows in enumerate(query_lens):
        for i in range(rows):
            length = torch.tensor([lens[b] - rows + 1 + i], dtype=torch.int32)
            alone = cpu_ops.paged_attention(
                q[row : row + 1],
                cache,
                tables[b : b + 1],
                length,
                torch.tensor([0, 1], dtype=torch.int32),
                0.125,
                None,
            )
            assert torch.equal(alone, together[row : row + 1]), f"sequence {b} row {i}"
            row += 1


@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize("query_lens", [None, (1, 9, 3, 66)])
def test_paged_attention_writes_the_new_keys_and_values(variant: str, block_size: int, query_lens) -> None:
    q, cache, tables, seq_lens, starts, keys, values = _paged_case(
        14, 2, 64, block_size, query_lens=query_lens
    )
    rows = (starts[1:] - starts[:-1]).tolist()
    slots = _new_slots(tables, seq_lens, starts, block_size)
    # Already in `cache`: compare against a garbage-filled copy.
    new_k = torch.cat([k[len(k) - r :] for k, r in zip(keys, rows, strict=True)])
    new_v = torch.cat([v[len(v) - r :] for v, r in zip(values, rows, strict=True)])
    expected = cpu_ops.paged_attention(q, cache, tables, seq_lens, starts, 0.125, None)
    stale = cache.clone()
    flat = stale.view(2, -1, 2, 64)
    flat[:, slots] = 7.0
    wide = torch.zeros(len(slots), 2 * 2 + 14, 64, dtype=torch.bfloat16)  # k and v as views into one row
    wide[:, 14:16], wide[:, 16:] = new_k, new_v
    out = cpu_ops.paged_attention(
        q, stale, tables, seq_lens, starts, 0.125, None, (wide[:, 14:16], wide[:, 16:], slots)
    )
    assert torch.equal(out, expected) and torch.equal(stale, cache)
    with pytest.raises(RuntimeError, match="is not the block table's slot"):
        cpu_ops.paged_attention(q, stale, tables, seq_lens, starts, 0.125, None, (new_k, new_v, slots + 1))


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(8, 8, 64), (14, 2, 64), (6, 1, 80)])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize(("lens", "query_lens"), [((1, 9, 33, 70), None), *MULTI_ROW])
def test_fp32_paged_attention_matches_dense(
    variant, heads, kv_heads, head_dim, block_size, window, lens, query_lens
) -> None:
    """fp32 models: the same kernel on fp32 tensors, fp32 throughout and nothing rounded."""
    q, cache, tables, seq_lens, starts, keys, values = _paged_case(
        heads, kv_heads, head_dim, block_size, lens, query_lens, dtype=torch.float32
    )
    scale = head_dim**-0.5
    out = cpu_ops.paged_attention(q, cache, tables, seq_lens, starts, scale, window)
    assert out.dtype == torch.float32 and out.shape == q.shape
    expected = _dense(q, keys, values, query_lens or [1] * len(lens), scale, window)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    # Writing the new rows in the same call gives the same result and the same cache.
    rows = (starts[1:] - starts[:-1]).tolist()
    slots = _new_slots(tables, seq_lens, starts, block_size)
    new_k = torch.cat([k[len(k) - r :] for k, r in zip(keys, rows, strict=True)])
    new_v = torch.cat([v[len(v) - r :] for v, r in zip(values, rows, strict=True)])
    stale = cache.clone()
    stale.view(2, -1, kv_heads, head_dim)[:, slots] = 7.0
    written = cpu_ops.paged_attention(
        q, stale, tables, seq_lens, starts, scale, window, (new_k, new_v, slots)
    )
    assert torch.equal(written, out) and torch.equal(stale, cache)


def test_paged_attention_rejects_mixed_dtypes(variant: str) -> None:
    q, cache, tables, seq_lens, starts, _, _ = _paged_case(4, 4, 16, 16, dtype=torch.float32)
    assert cpu_ops.attention_applies(q, cache) and not cpu_ops.attention_applies(q, cache.bfloat16())
    with pytest.raises(RuntimeError, match="float32 CPU tensor"):
        cpu_ops.paged_attention(q, cache.bfloat16(), tables, seq_lens, starts, 0.25, None)
    with pytest.raises(RuntimeError, match="bfloat16 CPU tensor"):
        cpu_ops.paged_attention(q.bfloat16(), cache, tables, seq_lens, starts, 0.25, None)
    assert not cpu_ops.attention_applies(q.half(), cache.half())


def test_paged_attention_rejects_bad_tables(variant: str) -> None:
    cache = torch.zeros(2, 4, 2, 1, 16, dtype=torch.bfloat16)
    q = torch.zeros(1, 2, 16, dtype=torch.bfloat16)
    one = torch.tensor([0, 1], dtype=torch.int32)

    def call(table, length, starts=one, rows=q):
        table = torch.tensor([table], dtype=torch.int32)
        cpu_ops.paged_attention(
            rows, cache, table, torch.tensor([length], dtype=torch.int32), starts, 1.0, None
        )

    with pytest.raises(RuntimeError, match="out of range"):
        call([7], 2)
    with pytest.raises(RuntimeError, match="beyond its block table"):
        call([0], 3)
    with pytest.raises(RuntimeError, match="query rows for length"):
        call([0, 1], 1, torch.tensor([0, 2], dtype=torch.int32), torch.zeros(2, 2, 16, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="query_start_loc must run from 0"):
        call([0], 2, torch.tensor([0, 2], dtype=torch.int32))


@requires_variants
def test_variants_agree_bit_for_bit() -> None:
    # Same fp32 operations in the same order on every variant (horizontal sums use one fixed tree),
    # except bf16 attention on avx512_bf16 (vdpbf16ps scores and P·V over bf16 weights): there within
    # bf16 tolerance.
    g = torch.Generator().manual_seed(5)
    norm = _norm(100, 3)
    x = (torch.randn(5, 100, generator=g) * 4).bfloat16()
    residual = torch.randn(5, 100, generator=g).bfloat16()
    rot = torch.randn(6, 5, 80, generator=g).bfloat16()
    cos, sin = torch.randn(6, 1, 80, generator=g).bfloat16().chunk(2, dim=-1)
    cases = [
        _paged_case(14, 2, 64, 16, lens=(1, 17, 300)),
        _paged_case(6, 1, 272, 5, lens=(40, 3)),
        _paged_case(14, 2, 64, 16, lens=(30, 300), query_lens=(9, 70)),
        _paged_case(14, 2, 64, 16, lens=(30, 300), query_lens=(9, 70), dtype=torch.float32),
    ]

    def run():
        rotated = rot.clone()
        cpu_ops.rotary_(rotated, cos, sin)
        outs = [*cpu_ops.add_rms_norm(x, residual, norm.weight, norm.eps), rotated]
        for q, cache, tables, seq_lens, starts, _, _ in cases:
            for window in (None, 9):
                outs.append(cpu_ops.paged_attention(q, cache, tables, seq_lens, starts, 0.125, window))
        return outs

    results = on_every_variant(run)
    first = results[RUNNABLE[0]]
    for name, outs in results.items():
        for i, (a, e) in enumerate(zip(outs, first, strict=True)):
            own_scores = (name == "avx512_bf16") != (RUNNABLE[0] == "avx512_bf16")
            if i >= 3 and a.dtype == torch.bfloat16 and own_scores:  # bf16 attention, vdpbf16ps on one side
                torch.testing.assert_close(a.double(), e.double(), atol=2e-2, rtol=2**-7)
            else:
                assert torch.equal(a, e), f"output {i}: {name} differs from {RUNNABLE[0]}"
    fp32_scores = [name for name in RUNNABLE if name != "avx512_bf16"]
    for name in fp32_scores[1:]:  # and those without vdpbf16ps agree bit for bit on everything
        for i, (a, e) in enumerate(zip(results[name], results[fp32_scores[0]], strict=True)):
            assert torch.equal(a, e), f"output {i}: {name} differs from {fp32_scores[0]}"
