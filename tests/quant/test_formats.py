"""The GGML formats: dequantizers equal gguf.quants.dequantize bit for bit on random blocks
(random scale bytes include subnormal, infinite and NaN fp16 scales); quantizers equal
gguf.quants.quantize bit for bit for every type it implements; K-quant blocks are valid and
decode within the error their bits allow."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from pagoda.quant.dequant import dequantize
from pagoda.quant.formats import (
    FILE_TYPES,
    SUPPORTED_TYPES,
    GGMLType,
    block_size,
    check_supported,
    row_bytes,
    type_size,
    with_fallback,
)
from pagoda.quant.quantize import quantize
from pagoda.quant.tensor import GGMLTensor

# Types gguf.quants can quantize (it has no K-quant quantizers).
REFERENCE_QUANTIZED = (
    GGMLType.F32,
    GGMLType.F16,
    GGMLType.BF16,
    GGMLType.Q8_0,
    GGMLType.Q4_0,
    GGMLType.Q4_1,
    GGMLType.Q5_0,
    GGMLType.Q5_1,
)
K_TYPES = (GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K)


def _bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES, ids=lambda t: t.name)
def test_dequantize_matches_gguf_on_random_blocks(qtype: GGMLType) -> None:
    rng = np.random.default_rng(int(qtype))
    raw = rng.integers(0, 256, size=(97, 3 * type_size(qtype)), dtype=np.uint8)
    # Add blocks whose fp16 scales are extreme: max finite, smallest subnormal, inf, NaN, zero.
    extreme = np.frombuffer(
        np.array([65504, 2**-24, np.inf, np.nan, 0.0, -65504], dtype=np.float16), np.uint8
    )
    rows = []
    for k in range(0, extreme.size, 2):
        row = rng.integers(0, 256, size=(1, 3 * type_size(qtype)), dtype=np.uint8)
        for offset in range(0, row.shape[1] - 1, 2):  # every fp16 position gets the scale
            row[0, offset : offset + 2] = extreme[k : k + 2]
        rows.append(row)
    raw = np.concatenate([raw, *rows])
    with np.errstate(all="ignore"):
        expected = gguf.quants.dequantize(raw, qtype)
    got = dequantize(torch.from_numpy(raw), qtype).numpy()
    assert _bits_equal(expected, got)


def _values(rows: int, cols: int, seed: int) -> np.ndarray:
    """Gaussian rows at scales from 1e-9 to 1e9, with zero blocks, ties, huge outliers and
    values near the fp16 range."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)) * np.exp(rng.uniform(-20, 20, size=(rows, 1)))
    x[0, :64] = 0.0  # all-zero blocks
    x[1, :32] = 1.0  # a constant block
    x[2, 3] = 1e30  # an outlier far past fp16
    x[3, :32] = np.arange(32) - 16.0  # equal magnitudes of both signs (argmax ties)
    x[4] = rng.choice([-1.0, 1.0], size=cols) * 60000.0
    x[5, :32] = 0.5 * np.arange(32)  # halves: rounding ties
    return x.astype(np.float32)


@pytest.mark.parametrize("qtype", REFERENCE_QUANTIZED, ids=lambda t: t.name)
def test_quantize_matches_gguf_bit_for_bit(qtype: GGMLType) -> None:
    x = _values(48, 512, int(qtype))
    with np.errstate(all="ignore"):
        expected = gguf.quants.quantize(x, qtype)
    expected = np.ascontiguousarray(expected).view(np.uint8).reshape(x.shape[0], -1)
    got = quantize(torch.from_numpy(x), qtype).numpy()
    assert got.shape == expected.shape
    assert np.array_equal(got, expected)


def test_bf16_quantize_keeps_nan_and_rounds_to_nearest_even() -> None:
    x = np.array([[np.nan, -np.nan, np.inf, -np.inf, 3.4e38, 1.00390625, 1.01171875, -0.0]], np.float32)
    got = quantize(torch.from_numpy(x), GGMLType.BF16).numpy()
    assert np.array_equal(got, gguf.quants.quantize(x, GGMLType.BF16).view(np.uint8).reshape(1, -1))


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
def test_k_quant_blocks_decode_within_their_error_bound(qtype: GGMLType) -> None:
    torch.manual_seed(0)
    # Row scales over six decades (the super-block scales are fp16, like llama.cpp's).
    x = torch.randn(64, 1024) * torch.logspace(-3, 3, 64).unsqueeze(1)
    blocks = quantize(x, qtype)
    assert blocks.shape == (64, row_bytes(qtype, 1024))
    back = dequantize(blocks, qtype)
    # The reference decoder reads the same values.
    assert _bits_equal(gguf.quants.dequantize(blocks.numpy(), qtype), back.numpy())
    # Each value is within one quantization step of its sub-block (levels 2^bits over the
    # sub-block's range, plus the rounding of the 6/8-bit scales): a loose bound from the format.
    bits = {GGMLType.Q4_K: 4, GGMLType.Q5_K: 5, GGMLType.Q6_K: 6}[qtype]
    sub = 32 if qtype != GGMLType.Q6_K else 16
    xs = x.reshape(64, -1, sub)
    span = xs.amax(-1, keepdim=True) - xs.amin(-1, keepdim=True).clamp(max=0)
    step = span / (2**bits - 1)
    err = (back.reshape(xs.shape) - xs).abs()
    assert bool((err <= 1.5 * step + 1e-30).all())
    # And the fit is good on average: relative RMS error of a Gaussian at these bit widths.
    rel = ((back - x).pow(2).mean(1) / x.pow(2).mean(1)).sqrt()
    assert float(rel.max()) < {4: 0.12, 5: 0.06, 6: 0.03}[bits]


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
def test_k_quant_zero_and_constant_super_blocks(qtype: GGMLType) -> None:
    x = torch.zeros(3, 256)
    x[1] = 2.5
    x[2, :32] = -1.0
    back = dequantize(quantize(x, qtype), qtype)
    assert torch.equal(back[0], torch.zeros(256))
    assert torch.allclose(back[1], x[1], rtol=0.02)
    assert torch.allclose(back[2], x[2], atol=0.02)


def test_row_helpers_and_fallbacks() -> None:
    assert row_bytes(GGMLType.Q4_K, 512) == 2 * 144
    with pytest.raises(ValueError, match="multiple of 256"):
        row_bytes(GGMLType.Q4_K, 896)
    assert with_fallback(GGMLType.Q4_K, 896) == GGMLType.Q5_0
    assert with_fallback(GGMLType.Q5_K, 896) == GGMLType.Q5_1
    assert with_fallback(GGMLType.Q6_K, 896) == GGMLType.Q8_0
    assert with_fallback(GGMLType.Q8_0, 688) == GGMLType.F16
    assert with_fallback(GGMLType.Q4_K, 4864) == GGMLType.Q4_K
    assert block_size(GGMLType.Q6_K) == 256
    with pytest.raises(ValueError, match="IQ2_XXS"):
        check_supported(GGMLType.IQ2_XXS, "tensor x")
    with pytest.raises(ValueError, match="type id 999"):
        check_supported(999, "tensor x")
    assert set(FILE_TYPES) >= {"q8_0", "q4_0", "q4_k_m", "q5_k_m", "q6_k", "bf16", "f32"}


def test_ggml_tensor_rows_work_on_raw_bytes() -> None:
    w = torch.randn(6, 64)
    t = GGMLTensor.quantize(w, GGMLType.Q4_0)
    index = torch.tensor([4, 0, 5])
    assert torch.equal(t.take_rows(index).dequantize(), t.dequantize()[index])
    both = GGMLTensor.cat([t, t.take_rows(index)])
    assert both.shape == (9, 64)
    assert torch.equal(both.dequantize()[6:], t.dequantize()[index])
    with pytest.raises(ValueError, match="uint8"):
        GGMLTensor(GGMLType.Q8_0, torch.zeros(2, 10, dtype=torch.uint8), (2, 64))
    with pytest.raises(ValueError, match="one type"):
        GGMLTensor.cat([t, GGMLTensor.quantize(w, GGMLType.Q8_0)])
