"""Quantized GEMMs against float64, within bounds derived from the formats: the integer kernels
(every ISA variant and integer dot product this CPU runs) on the dequantized weights and 8-bit
activations, the tiled layout against the file's bytes, and `QuantLinear` for 1 to 600 rows and
odd shapes in every type."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from pagoda.kernels import build, cpu_quant
from pagoda.quant.formats import QUANT_TYPES, GGMLType, block_size, row_bytes
from pagoda.quant.linear import QuantLinear
from pagoda.quant.tensor import GGMLTensor

VARIANTS = build.supported_variants()
needs_kernels = pytest.mark.skipif(not VARIANTS, reason="the CPU kernels need x86-64 with AVX2")
EPS32 = 2.0**-24  # float32 unit roundoff


def _dot_kinds() -> list[tuple[str, str]]:
    """(variant, integer dot product) pairs this CPU runs."""
    pairs = []
    for variant in VARIANTS:
        with build.use_variant(variant):
            pairs += [(variant, kind) for kind in cpu_quant.dot_kinds()]
    return pairs


DOT_KINDS = _dot_kinds()


def _bound(w: torch.Tensor, x: torch.Tensor, terms: int) -> torch.Tensor:
    """A float32 sum of `terms` rounded products: |error| <= terms * u * sum |w_k x_k| (plus one
    rounding per product), elementwise for x @ w.T."""
    return (terms + 2) * EPS32 * (x.abs().double() @ w.abs().double().t()) + 1e-30


def _x8(x: torch.Tensor) -> torch.Tensor:
    """The 8-bit activations the kernels multiply, as float32."""
    xq, xd, _ = cpu_quant.quantize_activations(x)
    return xq.float() * xd.repeat_interleave(32, dim=1)


def _weights(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(n, k, generator=gen) * torch.logspace(-2, 2, n).unsqueeze(1)


@needs_kernels
@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("swiglu", [False, True], ids=["plain", "swiglu"])
def test_tiled_layout_keeps_every_byte(qtype, swiglu):
    """Random bytes (any scale, NaN and infinity included) survive the repack exactly, rows in
    any order, with padding to whole tile pairs (odd row counts, a gate/up pairing)."""
    k = 2 * block_size(qtype) if block_size(qtype) == 256 else 96
    n = 38 if swiglu else 37
    raw = torch.randint(
        0, 256, (n, row_bytes(qtype, k)), dtype=torch.uint8, generator=torch.Generator().manual_seed(3)
    )
    packed = cpu_quant.pack(int(qtype), raw, k, swiglu)
    # Two tile pairs (64 rows). The inline layouts (the 32-value block types but Q8_0) hold a
    # pair per row, its scales among the values: the file's bytes.
    if qtype in (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1):
        assert packed.values.shape[0] == 2 and packed.scales.shape == (2, 0)
        assert packed.nbytes == 2 * 32 * row_bytes(qtype, k)
    else:
        assert packed.values.shape[0] == 4 and packed.scales.shape[0] == 4
    assert torch.equal(cpu_quant.raw_rows(packed, torch.arange(n)), raw)
    index = torch.tensor([n - 1, 0, n // 2, 0])
    assert torch.equal(cpu_quant.raw_rows(packed, index), raw[index])
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_quant.raw_rows(packed, torch.tensor([n]))


@needs_kernels
@pytest.mark.parametrize("variant, dot", DOT_KINDS)
@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize(
    "rows, n, k",
    [
        (1, 1, 32),
        (2, 45, 4864),
        (3, 17, 96),
        (4, 95, 416),
        (8, 300, 224),
        (9, 33, 64),
        (16, 129, 896),
        (40, 70, 160),
    ],
)
def test_integer_kernel_against_float64(variant, dot, qtype, rows, n, k):
    if block_size(qtype) == 256:
        k = 256 * (1 + k // 300)  # super-blocks of 256
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    w = _weights(n, k, gen)
    x = torch.randn(rows, k, generator=gen) * 3
    x[0, :32] = 0.0  # a zero activation block (scale 0)
    t = GGMLTensor.quantize(w, qtype)
    with build.use_variant(variant), cpu_quant.use_dot(dot):
        packed = cpu_quant.pack(int(qtype), t.data, k)
        xq, xd, xs = cpu_quant.quantize_activations(x)
        y = cpu_quant.linear(x, [packed])
    assert y.dtype == torch.float32 and y.shape == (rows, n)
    # The 8-bit activations: within half a step of their block's scale, sums as stated.
    scale = xd.repeat_interleave(32, dim=1)
    x8 = xq.float() * scale
    assert bool(((x8 - x).abs() <= 0.5 * scale * (1 + 1e-6) + 1e-30).all())
    assert torch.equal(xs, xq.int().reshape(rows, -1, 32).sum(-1))
    # Exact integer block products, then per block a few float32 roundings (the scales'
    # product, one or two multiply-adds, a minimum term): nb + 8 roundings on the sum of |products|.
    wd = t.dequantize()
    expected = x8.double() @ wd.double().t()
    assert bool(((y.double() - expected).abs() <= _bound(wd, x8, k // 32 + 8)).all())


@needs_kernels
@pytest.mark.parametrize("variant, dot", DOT_KINDS)
def test_epilogues_segments_and_bf16(variant, dot):
    """Several segments of different types in one call (x quantized once), a bias, SwiGLU on a
    paired gate/up weight, and bf16 in and out, against the float64 product."""
    gen = torch.Generator().manual_seed(11)
    k, rows = 512, 13
    parts = [(GGMLType.Q4_K, 40), (GGMLType.Q6_K, 24), (GGMLType.Q8_0, 7), (GGMLType.Q5_1, 33)]
    tensors = [GGMLTensor.quantize(_weights(n, k, gen), qt) for qt, n in parts]
    x = torch.randn(rows, k, generator=gen)
    bias = torch.randn(sum(n for _, n in parts), generator=gen)
    with build.use_variant(variant), cpu_quant.use_dot(dot):
        packed = [cpu_quant.pack(int(t.qtype), t.data, k) for t in tensors]
        y = cpu_quant.linear(x, packed, bias)
        x8 = _x8(x)
        gate_up = GGMLTensor.quantize(_weights(2 * 45, k, gen), GGMLType.Q5_0)  # 45: not a whole tile
        swiglu = cpu_quant.pack(int(gate_up.qtype), gate_up.data, k, swiglu=True)
        gb = torch.randn(90, generator=gen)
        xb = x.bfloat16()
        y_swiglu = cpu_quant.linear(xb, [swiglu], gb)
        x8b = _x8(xb)
        y_fp32 = cpu_quant.linear(xb, [swiglu], gb, out_dtype=torch.float32)
    wd = torch.cat([t.dequantize() for t in tensors])
    expected = x8.double() @ wd.double().t() + bias.double()
    bound = _bound(wd, x8, k // 32 + 8) + 2 * EPS32 * bias.abs().double()
    assert bool(((y.double() - expected).abs() <= bound).all())
    assert y_swiglu.dtype == torch.bfloat16 and y_swiglu.shape == (rows, 45)
    assert y_fp32.dtype == torch.float32
    assert torch.equal(y_fp32.bfloat16(), y_swiglu)  # one rounding to bf16 at the end
    gud = gate_up.dequantize()
    h = x8b.double() @ gud.double().t() + gb.double()
    g, u = h[:, :45], h[:, 45:]
    reference = torch.nn.functional.silu(g) * u
    # The GEMM's bound on gate and up, carried through silu(g) * u (|silu'| < 1.1), plus a few
    # relative roundings of the epilogue (exp to ~2e-7).
    bh = _bound(gud, x8b, k // 32 + 8) + 2 * EPS32 * gb.abs().double()
    bg, bu = bh[:, :45], bh[:, 45:]
    bound = 1.1 * bg * (u.abs() + bu) + torch.nn.functional.silu(g).abs() * bu + 1e-6 * reference.abs()
    assert bool(((y_fp32.double() - reference).abs() <= bound).all())


# Where a block's fp16 scale d sits, per type (bytes from the block's start; the minimum or
# dmin, where a type has one, follows it).
_D_OFFSET = {GGMLType.Q6_K: 208}


def _extreme_rows(qtype: GGMLType, n: int, k: int) -> torch.Tensor:
    """GGUF rows whose every value is its type's largest stored value (Q8_0: -128 and 127 in
    alternate rows), d = 1 and minimum / dmin = 0.5: the largest integer sums the kernels form."""
    raw = torch.full((n, row_bytes(qtype, k)), 0xFF, dtype=torch.uint8)
    blocks = raw.view(n, -1, row_bytes(qtype, block_size(qtype)))
    if qtype == GGMLType.Q8_0:
        blocks[0::2, :, 2:] = 0x80
        blocks[1::2, :, 2:] = 0x7F
    at = _D_OFFSET.get(qtype, 0)
    blocks[:, :, at : at + 2] = torch.tensor([0x00, 0x3C], dtype=torch.uint8)  # fp16 1.0
    if qtype in (GGMLType.Q4_1, GGMLType.Q5_1, GGMLType.Q4_K, GGMLType.Q5_K):
        blocks[:, :, 2:4] = torch.tensor([0x00, 0x38], dtype=torch.uint8)  # fp16 0.5
    return raw


@needs_kernels
@pytest.mark.parametrize("variant, dot", DOT_KINDS)
@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda t: t.name)
def test_largest_values_and_activations_stay_exact(variant, dot, qtype):
    """Every weight value at its type's extreme against activations of +-127 in every block: the
    integer sums at their largest (the kernels add up to 16 products in 16 bits before widening,
    so an overflow there would show), for 1 to 7 rows (every row block shape)."""
    n, k = 48, 512
    wd = GGMLTensor(qtype, _extreme_rows(qtype, n, k), (n, k)).dequantize()
    gen = torch.Generator().manual_seed(int(qtype))
    x = torch.ones(7, k)
    x[1::2] = -1.0
    x[4] = torch.randn(k, generator=gen)
    with build.use_variant(variant), cpu_quant.use_dot(dot):
        packed = cpu_quant.pack(int(qtype), _extreme_rows(qtype, n, k), k)
        x8 = _x8(x)
        for rows in range(1, 8):
            y = cpu_quant.linear(x[:rows], [packed])
            expected = x8[:rows].double() @ wd.double().t()
            assert bool(((y.double() - expected).abs() <= _bound(wd, x8[:rows], k // 32 + 8)).all()), rows


@needs_kernels
def test_every_variant_and_dot_product_gives_the_same_bits():
    """Also across row counts: a row's result does not depend on the others in its call."""
    gen = torch.Generator().manual_seed(5)
    w, x = torch.randn(70, 256, generator=gen), torch.randn(23, 256, generator=gen)
    results = []
    for variant, dot in DOT_KINDS:
        with build.use_variant(variant), cpu_quant.use_dot(dot):
            for qtype in QUANT_TYPES:
                packed = cpu_quant.pack(int(qtype), GGMLTensor.quantize(w, qtype).data, 256)
                full = cpu_quant.linear(x, [packed])
                assert torch.equal(cpu_quant.linear(x[5:6], [packed]), full[5:6])
                assert torch.equal(cpu_quant.linear(x[:7], [packed]), full[:7])
                results.append(full)
    for i in range(len(QUANT_TYPES), len(results)):
        assert torch.equal(results[i], results[i % len(QUANT_TYPES)])


@needs_kernels
def test_kernel_rejects_what_does_not_fit():
    packed = cpu_quant.pack(
        int(GGMLType.Q4_K), GGMLTensor.quantize(torch.randn(16, 256), GGMLType.Q4_K).data, 256
    )
    with pytest.raises(RuntimeError, match="multiple of 32"):
        cpu_quant.linear(torch.randn(2, 250), [packed])
    with pytest.raises(RuntimeError, match="does not match the tiled layout"):
        cpu_quant.linear(torch.randn(2, 512), [packed])
    with pytest.raises(RuntimeError, match="multiple of 256"):
        cpu_quant.pack(int(GGMLType.Q4_K), torch.zeros(1, 72, dtype=torch.uint8), 128)
    with pytest.raises(ValueError, match="no integer kernel"):
        cpu_quant.pack(int(GGMLType.F16), torch.zeros(1, 64, dtype=torch.uint8), 32)
    with pytest.raises(RuntimeError, match="not one of"):
        cpu_quant.use_dot("avx9000").__enter__()


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 7, 17, 600, 4097])
def test_quant_linear_rows_and_types(qtype, rows):
    """Odd output counts, a bias and a second segment of another type; float32 activations."""
    k = 512 if block_size(qtype) == 256 else 96
    gen = torch.Generator().manual_seed(int(qtype) * 7 + rows)
    w = torch.randn(67, k, generator=gen)
    x = torch.randn(rows, k, generator=gen)
    bias = torch.randn(67 + 5, generator=gen)
    segs = [
        GGMLTensor.quantize(w, qtype),
        GGMLTensor.quantize(torch.randn(5, k, generator=gen), GGMLType.Q8_0),
    ]
    layer = QuantLinear(segs, bias, swiglu=False)
    wd = torch.cat([s.dequantize() for s in segs])
    assert torch.equal(layer.dequantize(), wd)
    y = layer(x)
    assert y.shape == (rows, 72) and y.dtype == torch.float32
    integer = build.available()
    xs = _x8(x) if integer else x  # the integer path multiplies the 8-bit activations
    expected = xs.double() @ wd.double().t() + bias.double()
    bound = _bound(wd, xs, k) + 4 * EPS32 * bias.abs()
    assert bool(((y.double() - expected).abs() <= bound).all())


@pytest.mark.parametrize(
    "qtypes", [[GGMLType.Q8_0], [GGMLType.Q4_0, GGMLType.Q8_0]], ids=["fused", "segments"]
)
def test_quant_linear_swiglu_bf16_and_tied_rows(qtypes):
    """SwiGLU fused into the kernel (one segment) or after it (gate and up in different types)."""
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(2 * 40, 64, generator=gen)
    segs = [GGMLTensor.quantize(part, qt) for part, qt in zip(w.chunk(len(qtypes)), qtypes, strict=True)]
    layer = QuantLinear(segs, None, swiglu=True)
    x = torch.randn(3, 64, generator=gen).bfloat16()
    y = layer(x)
    assert y.shape == (3, 40) and y.dtype == torch.bfloat16
    wd = layer.dequantize()
    assert torch.equal(wd, torch.cat([s.dequantize() for s in segs]))
    xs = _x8(x) if build.available() else x.float()
    gate_up = xs.double() @ wd.double().t()
    expected = torch.nn.functional.silu(gate_up[:, :40]) * gate_up[:, 40:]
    torch.testing.assert_close(y.double(), expected, rtol=1e-2, atol=1e-2)  # bf16 output rounding
    index = torch.tensor([[5, 79], [0, 40]])
    assert torch.equal(layer.gather_rows(index), wd[index])


@needs_kernels
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("qtype", [GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q5_0], ids=lambda t: t.name)
@pytest.mark.parametrize("swiglu", [False, True], ids=["plain", "swiglu"])
def test_native_row_dequantize_is_the_reference(variant, qtype, swiglu):
    """Embedding rows dequantized straight from the tiles have the bits of gguf's dequantizer on
    the file's bytes: random bytes (NaN, infinite and subnormal scales), rows in any order,
    repeated, a gate/up pairing."""
    n, k = 38, 96
    raw = torch.randint(
        0, 256, (n, row_bytes(qtype, k)), dtype=torch.uint8, generator=torch.Generator().manual_seed(5)
    )
    # Some ordinary scales too (the random fp16 bytes are mostly huge or tiny).
    raw.view(-1, row_bytes(qtype, 32))[::2, :2] = torch.tensor([0x00, 0x3C], dtype=torch.uint8)  # 1.0
    index = torch.tensor([n - 1, 0, n // 2, 0, 7])
    with build.use_variant(variant):
        packed = cpu_quant.pack(int(qtype), raw, k, swiglu)
        got = cpu_quant.dequantize_rows(packed, index)
        with pytest.raises(RuntimeError, match="out of range"):
            cpu_quant.dequantize_rows(packed, torch.tensor([n]))
    with np.errstate(all="ignore"):
        expected = gguf.quants.dequantize(raw[index].numpy(), gguf.GGMLQuantizationType(int(qtype)))
    assert got.dtype == torch.float32 and got.shape == (len(index), k)
    assert got.numpy().view("uint32").tolist() == expected.astype("float32").view("uint32").tolist()


@needs_kernels
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows, blocks", [(1, 1), (3, 15), (2, 16), (5, 17), (4, 33), (33, 28)])
def test_activation_quantization_is_exact(variant, dtype, rows, blocks):
    """The 8-bit activations, 16 blocks of a row at a time and a partial last group: exactly
    d = max|x| / 127, q = round-half-even(x * (1 / d)) (0 where d is 0) and the block sums, in
    float32 as the formula reads; zero blocks and values at half steps included."""
    gen = torch.Generator().manual_seed(rows * 100 + blocks)
    k = 32 * blocks
    x = (torch.randn(rows, k, generator=gen) * torch.logspace(-3, 3, k)).to(dtype)
    x[0, :32] = 0.0
    if blocks > 1:  # a block at exact half steps: 127 and values (n + 0.5) * d
        x[-1, 32:64] = torch.tensor([127.0] + [n + 0.5 for n in range(-15, 16)]).to(dtype)
    with build.use_variant(variant):
        q, d, s = cpu_quant.quantize_activations(x)
    xf = x.float().reshape(rows, blocks, 32)
    amax = xf.abs().amax(-1)
    d_ref = amax / 127.0
    inv = torch.where(d_ref != 0, 1.0 / d_ref, torch.zeros_like(d_ref))
    q_ref = torch.round(xf * inv.unsqueeze(-1))  # round half to even
    assert torch.equal(d, d_ref)
    assert torch.equal(q.float(), q_ref.reshape(rows, k))
    assert torch.equal(s, q_ref.sum(-1).int())


@needs_kernels
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("rows", [1, 2, 31, 32, 33, 37, 215, 217, 433])
def test_split_over_threads_gives_the_same_bits(variant, rows):
    """Row groups (216 rows at K = 896: near-equal groups around that boundary) and tile pairs
    shared out over 1, 2 and 3 threads, segments of different sizes (q / k / v) and a SwiGLU
    weight: the same bits at every thread count, and each row's as when it runs alone."""
    gen = torch.Generator().manual_seed(rows)
    k = 896
    parts = [GGMLTensor.quantize(torch.randn(n, k, generator=gen), GGMLType.Q8_0) for n in (96, 32, 32)]
    gate_up = GGMLTensor.quantize(torch.randn(2 * 80, k, generator=gen), GGMLType.Q8_0)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    threads = torch.get_num_threads()
    results = []
    try:
        with build.use_variant(variant):
            packed = [cpu_quant.pack(int(t.qtype), t.data, k) for t in parts]
            swiglu = cpu_quant.pack(int(gate_up.qtype), gate_up.data, k, swiglu=True)
            for n in (1, 2, 3):
                torch.set_num_threads(n)
                results.append((cpu_quant.linear(x, packed), cpu_quant.linear(x, [swiglu])))
            alone = cpu_quant.linear(x[-1:], packed)
    finally:
        torch.set_num_threads(threads)
    for plain, fused in results[1:]:
        assert torch.equal(plain, results[0][0]) and torch.equal(fused, results[0][1])
    assert torch.equal(alone, results[0][0][-1:])
