"""The packed bf16 and fp32 GEMM on every kernel variant against fp64 references, bit-equality
across variants where they do the same arithmetic (fp32 multiply-adds; avx512_bf16 multiplies
bf16 inputs with vdpbf16ps), the bf16 rounding store against torch's conversion, and the layers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernel_variants import RUNNABLE, on_every_variant, requires_variants
from pagoda.kernels import cpu_gemm
from pagoda.layers import GateUpLinear, Linear, PackedLinear


def _make(m: int, n: int, k: int, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    return x, w, b


def _reference(x, w, b):
    """The exact product in fp64 and the sum of absolute terms (a bound on summation error)."""
    ref = x.double() @ w.double().T
    if b is not None:
        ref = ref + b.double()
    return ref, x.double().abs() @ w.double().abs().T


def _assert_close(y: torch.Tensor, ref: torch.Tensor, abs_sum: torch.Tensor) -> None:
    """y must be the exact result with fp32 summation error, rounded once to y's dtype."""
    ulp = 2.0**-8 if y.dtype == torch.bfloat16 else 2.0**-23
    tol = ref.abs() * ulp + abs_sum * 2.0**-20 + 1e-30
    err = (y.double() - ref).abs()
    assert y.shape == ref.shape
    assert torch.all(err <= tol), f"max error {err.max().item()} over tolerance"


@pytest.mark.parametrize("m", [*range(1, 17), 29, 32, 57, 300, 600])
@pytest.mark.parametrize(("n", "k"), [(37, 100), (1, 31), (64, 1), (5, 0), (200, 70)])
def test_plain_matches_reference(variant: str, m: int, n: int, k: int) -> None:
    x, w, b = _make(m, n, k, bias=m % 2 == 0, seed=m)
    packed = cpu_gemm.pack(w, b)
    ref, abs_sum = _reference(x, w, b)
    y32 = cpu_gemm.linear(x, packed, out_dtype=torch.float32)
    assert y32.dtype == torch.float32
    _assert_close(y32, ref, abs_sum)
    y16 = cpu_gemm.linear(x, packed, out_dtype=torch.bfloat16)
    assert y16.dtype == torch.bfloat16
    # The bf16 output is the fp32 one rounded once, exactly as torch rounds.
    assert torch.equal(y16, y32.bfloat16())
    _assert_close(cpu_gemm.linear(x.float(), packed, out_dtype=torch.float32), ref, abs_sum)


@pytest.mark.parametrize("m", [65, 130])
@pytest.mark.parametrize("k", [4500, 4501])
def test_long_rows_in_groups_match_reference(variant: str, m: int, k: int) -> None:
    # Past 64 rows, rows go in groups of at most 128 KB of x (on avx2, fp32 rows of 4,500 k:
    # one 4-row block per group): every group and thread split gives the exact result and the
    # same bits.
    x, w, b = _make(m, 70, k, bias=True, seed=k)
    packed = cpu_gemm.pack(w, b)
    ref, abs_sum = _reference(x, w, b)
    y = cpu_gemm.linear(x, packed, out_dtype=torch.float32)
    _assert_close(y, ref, abs_sum)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = cpu_gemm.linear(x, packed, out_dtype=torch.float32)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(single, y)


@pytest.mark.parametrize("m", [1, 3, 7, 14, 33, 300])
@pytest.mark.parametrize("intermediate", [1, 16, 37, 96])
@pytest.mark.parametrize("bias", [False, True])
def test_swiglu_matches_reference(variant: str, m: int, intermediate: int, bias: bool) -> None:
    x, w, b = _make(m, 2 * intermediate, 48 - m % 2, bias=bias, seed=intermediate)
    packed = cpu_gemm.pack(w, b, swiglu=True)
    assert packed.out_features == intermediate
    h, abs_sum = _reference(x, w, b)
    gate, up = h[:, :intermediate], h[:, intermediate:]
    ref = F.silu(gate) * up
    # Error of silu(g) * u from the sums' error: |silu'(g)| <= 1.1, |silu(g)| <= |g|.
    sum_err = abs_sum * 2.0**-20
    tol_in = 1.1 * sum_err[:, :intermediate] * up.abs() + gate.abs() * sum_err[:, intermediate:]
    y = cpu_gemm.linear(x, packed, out_dtype=torch.float32)
    err = (y.double() - ref).abs()
    assert torch.all(err <= ref.abs() * 1e-6 + tol_in + 1e-30), err.max().item()
    y16 = cpu_gemm.linear(x, packed)
    assert y16.dtype == torch.bfloat16
    assert torch.equal(y16, y.bfloat16())


@requires_variants
@pytest.mark.parametrize(
    ("m", "n", "k", "swiglu"), [(1, 4099, 300, False), (13, 200, 65, True), (600, 97, 130, False)]
)
def test_variants_agree_bit_for_bit(m: int, n: int, k: int, swiglu: bool) -> None:
    # The fp32 multiply-add path sums each output over k in the same order on every variant;
    # avx512_bf16 takes it for fp32 inputs, and vdpbf16ps (its own order) for bf16 ones.
    x, w, b = _make(m, 2 * n if swiglu else n, k, bias=True, seed=k)

    def run():
        packed = cpu_gemm.pack(w, b, swiglu=swiglu)
        return packed.data, cpu_gemm.linear(x.float(), packed, torch.float32), cpu_gemm.linear(x, packed)

    results = on_every_variant(run)
    fma = [name for name in RUNNABLE if name != "avx512_bf16"]
    first = results[fma[0]]
    for name, (data, y_fp32_in, y_bf16_in) in results.items():
        assert torch.equal(data, first[0]), f"{name} packs differently"
        assert torch.equal(y_fp32_in, first[1]), f"{name} differs from {fma[0]}"
        if name in fma:
            assert torch.equal(y_bf16_in, first[2]), f"{name} differs from {fma[0]}"
        else:  # different summation order: within a bf16 rounding of the fp32 path's result
            torch.testing.assert_close(y_bf16_in, first[2], rtol=2**-7, atol=1e-2)


# fp32 bit patterns at the edges of the bf16 rounding: ties to even, carries into the exponent,
# overflow to infinity, denormals, signed zeros, infinities and NaNs of every sign and payload.
_SPECIAL_BITS = [
    0x3F800000, 0x3F808000, 0x3F818000, 0x3F80FFFF, 0x3F7FFFFF, 0xBF808001, 0x7F7FFFFF, 0x7F7F7FFF,
    0xFF7F8000, 0x00000001, 0x007FFFFF, 0x80008000, 0x807FFFFF, 0x00800000, 0x00000000, 0x80000000,
    0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FA00000, 0xFF812345, 0x7FFFFFFF,
]  # fmt: skip


def _is_denormal_or_nan(bits: torch.Tensor) -> torch.Tensor:
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    return ((exponent == 0) & (mantissa != 0)) | ((exponent == 0xFF) & (mantissa != 0))


def test_bf16_store_rounds_like_torch(variant: str) -> None:
    # K = 1 and a weight of ones: each fp32 output is exactly its input, then stored as bf16.
    bits = torch.tensor(_SPECIAL_BITS, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32).repeat(3)[:, None]  # 72 rows: full and partial vectors
    packed = cpu_gemm.pack(torch.ones(19, 1, dtype=torch.bfloat16))
    y32 = cpu_gemm.linear(x, packed, out_dtype=torch.float32)
    y16 = cpu_gemm.linear(x, packed)
    expected = y32.bfloat16()
    same = y16.view(torch.int16) == expected.view(torch.int16)
    if variant != "avx512_bf16":
        assert torch.all(same), "the integer rounding must equal torch's conversion bit for bit"
        return
    # The native instruction: the same everywhere except denormal inputs (flushed to signed zero)
    # and NaNs (quietened, keeping sign and payload, where torch writes 0xFFFF).
    special = _is_denormal_or_nan(y32.view(torch.int32))
    assert torch.all(same | special)
    assert torch.equal(y16[special].isnan(), y32[special].isnan())
    flushed = special & ~y32.isnan()
    assert torch.all(y16[flushed] == 0)


def test_unpack_and_gather_rows_return_the_original(variant: str) -> None:
    for n, swiglu in ((45, False), (64, False), (2 * 37, True)):
        _, w, b = _make(1, n, 24, bias=True)
        packed = cpu_gemm.pack(w, b, swiglu=swiglu)
        assert torch.equal(cpu_gemm.unpack(packed), w)
        if not swiglu:
            ids = torch.tensor([[0, 31, 32, n - 1], [16, 15, 1, 2]])
            assert torch.equal(cpu_gemm.gather_rows(packed, ids), w[ids])


@pytest.mark.parametrize("m", [1, 5, 32, 600])
def test_thread_count_does_not_change_results(variant: str, m: int) -> None:
    # Every output's summation order is fixed, so any split over threads gives equal bits.
    x, w, b = _make(m, 4099, 300, bias=True)
    packed = cpu_gemm.pack(w, b)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = cpu_gemm.linear(x, packed)
        torch.set_num_threads(max(2, before))
        multi = cpu_gemm.linear(x, packed)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(single, multi)


@pytest.mark.parametrize("k", [130, 131])
def test_inputs_of_any_layout_and_fp32(variant: str, k: int) -> None:
    x, w, b = _make(6, 67, k, bias=True)
    packed = cpu_gemm.pack(w, b)
    expected = cpu_gemm.linear(x, packed)
    x_cols = torch.zeros(6, 2 * k, dtype=torch.bfloat16)
    x_cols[:, ::2] = x
    wide = torch.zeros(6, k + 5, dtype=torch.bfloat16)  # rows with a stride beyond K
    wide[:, :k] = x
    for xi in (x_cols[:, ::2], x.T.contiguous().T, wide[:, :k]):
        assert torch.equal(cpu_gemm.linear(xi, packed), expected)
    from_fp32 = cpu_gemm.linear(x.float(), packed)
    if variant == "avx512_bf16":  # fp32 inputs take the multiply-add path, bf16 ones vdpbf16ps
        torch.testing.assert_close(from_fp32, expected, rtol=2**-7, atol=1e-2)
    else:
        assert torch.equal(from_fp32, expected)
    assert torch.equal(cpu_gemm.linear(x.reshape(2, 3, k), packed), expected.reshape(2, 3, 67))
    assert torch.equal(cpu_gemm.linear(x[0], packed), expected[0])
    assert cpu_gemm.linear(x[:0], packed).shape == (0, 67)


def _make_fp32(m: int, n: int, k: int, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    return x, w, torch.randn(n, generator=g) if bias else None


def _fp32_sums(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """What the fp32-weight kernel computes: each output summed over k in order with fused
    multiply-adds (a product rounded once with its sum), done in fp64 and rounded per step."""
    acc = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float32)
    for k in range(x.shape[1]):
        acc = (acc.double() + x[:, k : k + 1].double() * w[:, k].double()).float()
    return acc if b is None else acc + b


@pytest.mark.parametrize("m", [*range(1, 15), 29, 57, 300])
@pytest.mark.parametrize(("n", "k"), [(37, 100), (1, 31), (64, 1), (5, 0), (200, 70)])
def test_fp32_weights_match_reference(variant: str, m: int, n: int, k: int) -> None:
    x, w, b = _make_fp32(m, n, k, bias=m % 2 == 1, seed=m)
    packed = cpu_gemm.pack(w, b)
    assert packed.dtype == torch.float32 and packed.data.shape == (-(-n // 16), k, 16)
    y = cpu_gemm.linear(x, packed)
    assert y.dtype == torch.float32  # an fp32 weight gives fp32 out by default
    ref, abs_sum = _reference(x, w, b)
    _assert_close(y, ref, abs_sum)
    if k <= 100 and m <= 14:
        # Sums over k in order, one fused multiply-add per k: exactly the sequential fp32 sum.
        assert torch.equal(y, _fp32_sums(x, w, b))
    assert torch.equal(cpu_gemm.linear(x, packed, out_dtype=torch.bfloat16), y.bfloat16())
    # bf16 inputs are widened exactly: the same result as their fp32 values.
    assert torch.equal(cpu_gemm.linear(x.bfloat16(), packed), cpu_gemm.linear(x.bfloat16().float(), packed))


@pytest.mark.parametrize("m", [1, 7, 33])
@pytest.mark.parametrize("bias", [False, True])
def test_fp32_weights_swiglu_matches_reference(variant: str, m: int, bias: bool) -> None:
    intermediate = 37
    x, w, b = _make_fp32(m, 2 * intermediate, 48, bias=bias, seed=m)
    packed = cpu_gemm.pack(w, b, swiglu=True)
    h, abs_sum = _reference(x, w, b)
    ref = F.silu(h[:, :intermediate]) * h[:, intermediate:]
    sum_err = abs_sum * 2.0**-20
    tol = 1.1 * sum_err[:, :intermediate] * h[:, intermediate:].abs()
    tol += h[:, :intermediate].abs() * sum_err[:, intermediate:]
    y = cpu_gemm.linear(x, packed)
    assert y.dtype == torch.float32 and y.shape == (m, intermediate)
    err = (y.double() - ref).abs()
    assert torch.all(err <= ref.abs() * 1e-6 + tol + 1e-30), err.max().item()


@requires_variants
@pytest.mark.parametrize(
    ("m", "n", "k", "swiglu"), [(1, 4099, 300, False), (13, 200, 65, True), (600, 97, 130, False)]
)
def test_fp32_weights_agree_bit_for_bit_across_variants_and_threads(
    m: int, n: int, k: int, swiglu: bool
) -> None:
    x, w, b = _make_fp32(m, 2 * n if swiglu else n, k, bias=True, seed=k)

    def run():
        packed = cpu_gemm.pack(w, b, swiglu=swiglu)
        before = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            single = cpu_gemm.linear(x, packed)
            torch.set_num_threads(max(2, before))
            return packed.data, single, cpu_gemm.linear(x, packed)
        finally:
            torch.set_num_threads(before)

    results = on_every_variant(run)
    first = next(iter(results.values()))
    for name, (data, single, multi) in results.items():
        assert torch.equal(data, first[0]), f"{name} packs differently"
        assert torch.equal(single, first[1]) and torch.equal(multi, first[1]), f"{name} differs"


def test_fp32_unpack_and_gather_rows_return_the_original(variant: str) -> None:
    for n, swiglu in ((45, False), (2 * 37, True)):
        _, w, b = _make_fp32(1, n, 24, bias=True)
        packed = cpu_gemm.pack(w, b, swiglu=swiglu)
        assert torch.equal(cpu_gemm.unpack(packed), w)
        if not swiglu:
            ids = torch.tensor([[0, 31, 32, n - 1], [16, 15, 1, 2]])
            assert torch.equal(cpu_gemm.gather_rows(packed, ids), w[ids])


def test_bad_input_is_rejected(variant: str) -> None:
    x, w, b = _make(2, 6, 4, bias=True)
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        cpu_gemm.pack(w.half())
    with pytest.raises(ValueError, match="even number of rows"):
        cpu_gemm.pack(w[:5], swiglu=True)
    with pytest.raises(ValueError, match="bias"):
        cpu_gemm.pack(w, b[:5])
    packed = cpu_gemm.pack(w, b)
    with pytest.raises(ValueError, match="features"):
        cpu_gemm.linear(torch.zeros(2, 5, dtype=torch.bfloat16), packed)
    with pytest.raises(ValueError, match="out_dtype"):
        cpu_gemm.linear(x, packed, out_dtype=torch.float16)
    with pytest.raises(ValueError, match="autograd"):
        cpu_gemm.linear(x.float().requires_grad_(), packed)
    with pytest.raises(ValueError, match="plain"):
        cpu_gemm.gather_rows(cpu_gemm.pack(w, swiglu=True), torch.tensor([0]))


def _load(layer: torch.nn.Module, generator: torch.Generator) -> None:
    for param in layer.parameters():
        param.copy_(torch.randn(param.shape, generator=generator))


def test_layers_pack_bf16_weights_and_keep_their_results(variant: str) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, 40, generator=g).bfloat16()
    plain, packed_linear = (
        Linear(40, 24, True, torch.bfloat16),
        PackedLinear(40, [("a", 8), ("b", 20)], True, torch.bfloat16),
    )
    gate_up = GateUpLinear(40, 19, True, torch.bfloat16)
    for layer in (plain, packed_linear, gate_up):
        _load(layer, g)
        before = layer(x).double()
        weight = layer.weight.detach().clone()
        layer.process_weights_after_loading()
        assert layer.packed is not None and layer.weight is None and layer.bias is None
        assert torch.equal(cpu_gemm.unpack(layer.packed), weight)
        after = layer(x)
        assert after.dtype == torch.bfloat16 and after.shape == before.shape
        torch.testing.assert_close(after.double(), before, atol=0.1, rtol=2e-2)
    assert gate_up(x).shape == (9, 19)


def test_layers_pack_fp32_weights(variant: str) -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(9, 40, generator=g)
    for layer in (Linear(40, 24, True, torch.float32), GateUpLinear(40, 19, True, torch.float32)):
        _load(layer, g)
        before = layer(x).double()
        weight = layer.weight.detach().clone()
        layer.process_weights_after_loading()
        assert layer.packed is not None and layer.packed.dtype == torch.float32 and layer.weight is None
        assert torch.equal(cpu_gemm.unpack(layer.packed), weight)
        after = layer(x)
        assert after.dtype == torch.float32
        torch.testing.assert_close(after.double(), before, atol=1e-5, rtol=1e-5)


def test_float16_layers_stay_unpacked() -> None:
    layer = Linear(8, 4, False, torch.float16)
    _load(layer, torch.Generator().manual_seed(0))
    layer.process_weights_after_loading()
    assert layer.packed is None and layer.weight is not None


def test_bench_cli_rejects_bad_arguments() -> None:
    with pytest.raises(SystemExit):
        cpu_gemm.main([])
    with pytest.raises(SystemExit):
        cpu_gemm.main(["--bench", "--m", "0"])
