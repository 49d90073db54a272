"""Quantized GEMMs against float64, within bounds derived from the formats: the integer kernels
(every ISA variant this CPU runs) on the dequantized weights and 8-bit activations, and
`QuantLinear` for 1 to 600 rows and odd shapes in every type."""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels import build, cpu_quant
from pagoda.quant.formats import QUANT_TYPES, GGMLType, block_size
from pagoda.quant.linear import INTEGER_MAX_ROWS, QuantLinear
from pagoda.quant.tensor import GGMLTensor

VARIANTS = build.supported_variants()
KERNEL_TYPES = [GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q5_0, GGMLType.Q4_K, GGMLType.Q6_K]
EPS32 = 2.0**-24  # float32 unit roundoff


def _bound(w: torch.Tensor, x: torch.Tensor, terms: int) -> torch.Tensor:
    """A float32 sum of `terms` rounded products: |error| <= terms * u * sum |w_k x_k| (plus one
    rounding per product), elementwise for x @ w.T."""
    return (terms + 2) * EPS32 * (x.abs().double() @ w.abs().double().t()) + 1e-30


@pytest.mark.skipif(not VARIANTS, reason="the CPU kernels need x86-64 with AVX2")
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows, n, k", [(1, 1, 32), (3, 17, 96), (8, 300, 224), (9, 33, 64), (16, 129, 896)])
def test_integer_kernel_against_float64(variant, qtype, rows, n, k):
    if qtype in (GGMLType.Q4_K, GGMLType.Q6_K):
        k = 256 * (1 + k // 300)  # super-blocks of 256
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    w = torch.randn(n, k, generator=gen) * torch.logspace(-2, 2, n).unsqueeze(1)
    x = torch.randn(rows, k, generator=gen) * 3
    x[0, :32] = 0.0  # a zero activation block (scale 0)
    t = GGMLTensor.quantize(w, qtype)
    with build.use_variant(variant):
        packed = cpu_quant.pack(int(qtype), t.data, k)
        if not packed.raw:
            assert torch.equal(cpu_quant.dequantize(packed), t.dequantize())  # the repack keeps every value
        xq, xd, xs = cpu_quant.quantize_activations(x)
        y = cpu_quant.linear(x, packed, (xq, xd, xs))
    # The 8-bit activations: within half a step of their block's scale, sums as stated.
    scale = xd.repeat_interleave(32, dim=1)
    x8 = xq.float() * scale
    assert bool(((x8 - x).abs() <= 0.5 * scale * (1 + 1e-6) + 1e-30).all())
    assert torch.equal(xs, xq.int().reshape(rows, -1, 32).sum(-1))
    # Exact integer block products, then one float32 multiply-add per block (and the two scales'
    # product): nb + 2 roundings on the sum of |products|.
    wd = t.dequantize()
    expected = x8.double() @ wd.double().t()
    assert bool(((y.double() - expected).abs() <= _bound(wd, x8, k // 32 + 8)).all())


@pytest.mark.skipif(not VARIANTS, reason="the CPU kernels need x86-64 with AVX2")
def test_every_variant_gives_the_same_bits():
    w, x = torch.randn(70, 256), torch.randn(5, 256)
    results = []
    for variant in VARIANTS:
        with build.use_variant(variant):
            for qtype in KERNEL_TYPES:
                packed = cpu_quant.pack(int(qtype), GGMLTensor.quantize(w, qtype).data, 256)
                results.append(cpu_quant.linear(x, packed))
    for i in range(len(KERNEL_TYPES), len(results)):
        assert torch.equal(results[i], results[i % len(KERNEL_TYPES)])


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 7, 17, 600, INTEGER_MAX_ROWS + 1])
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
    integer = rows <= INTEGER_MAX_ROWS and build.available()
    if integer:
        # Q8_0 / Q4_0 segments took 8-bit activations: compare against those (both segments read
        # the same rounded x; other types took x as it is).
        xq, xd, _ = cpu_quant.quantize_activations(x)
        x8 = xq.float() * xd.repeat_interleave(32, dim=1)
        xs = [x8 if cpu_quant.supports(s.qtype, k) else x for s in segs]
    else:
        xs = [x, x]
    expected = torch.cat(
        [xi.double() @ s.dequantize().double().t() for xi, s in zip(xs, segs, strict=True)], -1
    )
    expected += bias.double()
    bound = (
        torch.cat([_bound(s.dequantize(), xi, k) for xi, s in zip(xs, segs, strict=True)], -1)
        + 4 * EPS32 * bias.abs()
    )
    assert bool(((y.double() - expected).abs() <= bound).all())


def test_quant_linear_swiglu_bf16_and_tied_rows():
    w = torch.randn(2 * 40, 64)
    layer = QuantLinear([GGMLTensor.quantize(w, GGMLType.Q8_0)], None, swiglu=True)
    x = torch.randn(3, 64).bfloat16()
    y = layer(x)
    assert y.shape == (3, 40) and y.dtype == torch.bfloat16
    wd = layer.dequantize()
    gate_up = x.float() @ wd.t()
    if build.available():  # integer path: compare against the 8-bit activations it used
        xq, xd, _ = cpu_quant.quantize_activations(x)
        gate_up = (xq.float() * xd.repeat_interleave(32, 1)) @ wd.t()
    expected = torch.nn.functional.silu(gate_up[:, :40]) * gate_up[:, 40:]
    torch.testing.assert_close(y.float(), expected, rtol=1e-2, atol=1e-2)  # bf16 output rounding
    index = torch.tensor([[5, 79], [0, 40]])
    assert torch.equal(layer.gather_rows(index), wd[index])
