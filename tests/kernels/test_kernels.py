"""The CPU kernels against fp64 references (packed bf16 GEMM, RMSNorm, paged decode attention),
the layers that use them, and their fallbacks."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch
import torch.nn.functional as F

from pagoda.kernels import build, cpu_gemm, cpu_ops
from pagoda.layers import GateUpLinear, Linear, PackedLinear, RMSNorm, apply_rotary

requires_kernel = pytest.mark.skipif(
    not build.available(),
    reason=f"CPU kernels unavailable: {build.unavailable_reason() or 'build failed'}",
)


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


@requires_kernel
@pytest.mark.parametrize("m", [*range(1, 17), 29, 32, 57, 300, 600])
@pytest.mark.parametrize(("n", "k"), [(37, 100), (1, 31), (64, 1), (5, 0), (200, 70)])
def test_plain_matches_reference(m: int, n: int, k: int) -> None:
    x, w, b = _make(m, n, k, bias=m % 2 == 0, seed=m)
    packed = cpu_gemm.pack(w, b)
    ref, abs_sum = _reference(x, w, b)
    for out_dtype in (torch.bfloat16, torch.float32):
        y = cpu_gemm.linear(x, packed, out_dtype=out_dtype)
        assert y.dtype == out_dtype
        _assert_close(y, ref, abs_sum)


@requires_kernel
@pytest.mark.parametrize("m", [1, 3, 7, 14, 33, 300])
@pytest.mark.parametrize("intermediate", [1, 16, 37, 96])
@pytest.mark.parametrize("bias", [False, True])
def test_swiglu_matches_reference(m: int, intermediate: int, bias: bool) -> None:
    x, w, b = _make(m, 2 * intermediate, 48, bias=bias, seed=intermediate)
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
    assert torch.all((y16.double() - ref).abs() <= ref.abs() * 2.0**-8 + tol_in + 1e-30)


@requires_kernel
@pytest.mark.parametrize(("n", "swiglu"), [(45, False), (64, False), (2 * 37, True)])
def test_unpack_and_gather_rows_return_the_original(n: int, swiglu: bool) -> None:
    _, w, b = _make(1, n, 24, bias=True)
    packed = cpu_gemm.pack(w, b, swiglu=swiglu)
    assert torch.equal(cpu_gemm.unpack(packed), w)
    if not swiglu:
        ids = torch.tensor([[0, 31, 32, n - 1], [16, 15, 1, 2]])
        assert torch.equal(cpu_gemm.gather_rows(packed, ids), w[ids])


@requires_kernel
@pytest.mark.parametrize("m", [1, 5, 32, 600])
def test_thread_count_does_not_change_results(m: int) -> None:
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


@requires_kernel
def test_inputs_of_any_layout_and_fp32() -> None:
    x, w, b = _make(6, 67, 130, bias=True)
    packed = cpu_gemm.pack(w, b)
    expected = cpu_gemm.linear(x, packed)
    x_cols = torch.zeros(6, 260, dtype=torch.bfloat16)
    x_cols[:, ::2] = x
    for xi in (x_cols[:, ::2], x.T.contiguous().T, x.float()):
        assert torch.equal(cpu_gemm.linear(xi, packed), expected)
    assert torch.equal(cpu_gemm.linear(x.reshape(2, 3, 130), packed), expected.reshape(2, 3, 67))
    assert torch.equal(cpu_gemm.linear(x[0], packed), expected[0])
    assert cpu_gemm.linear(x[:0], packed).shape == (0, 67)


@requires_kernel
def test_bad_input_is_rejected() -> None:
    x, w, b = _make(2, 6, 4, bias=True)
    with pytest.raises(ValueError, match="bfloat16"):
        cpu_gemm.pack(w.float())
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


@requires_kernel
def test_layers_pack_bf16_weights_and_keep_their_results() -> None:
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


def test_float32_layers_stay_unpacked() -> None:
    layer = Linear(8, 4, False, torch.float32)
    _load(layer, torch.Generator().manual_seed(0))
    layer.process_weights_after_loading()
    assert layer.packed is None and layer.weight is not None


@requires_kernel
@pytest.mark.parametrize("rows", [1, 7])
@pytest.mark.parametrize("hidden", [16, 64, 100])
def test_rms_norm_rounds_like_the_torch_path(rows: int, hidden: int) -> None:
    g = torch.Generator().manual_seed(hidden)
    norm = RMSNorm(hidden, 1e-6, torch.bfloat16)
    norm.weight.copy_(torch.randn(hidden, generator=g))
    x = (torch.randn(rows, 3, hidden, generator=g) * 4).bfloat16()
    residual = torch.randn(rows, 3, hidden, generator=g).bfloat16()
    out, summed = cpu_ops.add_rms_norm(x, residual, norm.weight, norm.eps)
    assert torch.equal(summed, residual + x)
    torch.testing.assert_close(out, norm._norm(residual + x), atol=0, rtol=2**-7)  # one bf16 ulp at most
    alone, same = cpu_ops.add_rms_norm(x[:, 0], None, norm.weight, norm.eps)
    assert same is not None and torch.equal(same, x[:, 0])
    torch.testing.assert_close(alone, norm._norm(x[:, 0]), atol=0, rtol=2**-7)


@requires_kernel
@pytest.mark.parametrize(("tokens", "heads", "head_dim"), [(1, 16, 64), (7, 3, 16), (5, 2, 80)])
def test_rotary_in_place_equals_the_torch_expression(tokens: int, heads: int, head_dim: int) -> None:
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


@requires_kernel
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"), [(4, 4, 16), (14, 2, 64), (6, 1, 80), (8, 2, 128), (4, 2, 272)]
)
@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize("window", [None, 1, 7])
def test_paged_decode_attention_matches_dense(heads, kv_heads, head_dim, block_size, window) -> None:
    g = torch.Generator().manual_seed(head_dim + block_size)
    num_blocks, lens = 128, [1, 9, 33, 70]
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
    scale = head_dim**-0.5
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out = cpu_ops.paged_decode_attention(q, cache, tables, seq_lens, scale, window)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    expected = _dense_decode(q, keys, values, scale, window)
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2**-7)
    # A strided query (a view into a wider qkv row) gives the same result.
    wide = torch.zeros(len(lens), heads + 3, head_dim, dtype=torch.bfloat16)
    wide[:, :heads] = q
    assert torch.equal(
        cpu_ops.paged_decode_attention(wide[:, :heads], cache, tables, seq_lens, scale, window), out
    )


@requires_kernel
def test_paged_decode_attention_rejects_bad_tables() -> None:
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


def test_disabled_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(build.DISABLE_ENV, "1")
    # The environment is read once per process, at first use: start from a fresh, unresolved build.
    monkeypatch.setattr(build, "_KERNELS", build.LazyBuild(build._build))
    assert build.DISABLE_ENV in (build.unavailable_reason() or "")
    assert not build.available()
    assert not cpu_ops.applies(torch.zeros(1, dtype=torch.bfloat16))
    layer = Linear(8, 4, True, torch.bfloat16)
    _load(layer, torch.Generator().manual_seed(0))
    layer.process_weights_after_loading()
    assert layer.packed is None
    x = torch.randn(3, 8).bfloat16()
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    with pytest.raises(RuntimeError, match="unavailable"):
        cpu_gemm.pack(layer.weight)


def test_build_failure_is_logged_once_and_disables(caplog: pytest.LogCaptureFixture) -> None:
    calls = []

    def failing_build():
        calls.append(1)
        raise RuntimeError("no compiler")

    kernel = build.LazyBuild(failing_build)
    with caplog.at_level(logging.WARNING, logger=build.__name__):
        assert kernel.get() is False
        assert kernel.get() is False
    assert len(calls) == 1
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "no compiler" in warnings[0].getMessage()


def test_build_runs_once_across_threads() -> None:
    calls = []

    def slow_build():
        calls.append(1)
        time.sleep(0.05)
        return True

    kernel = build.LazyBuild(slow_build)
    results = []
    threads = [threading.Thread(target=lambda: results.append(kernel.get())) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert results == [True] * 8


def test_bench_cli_rejects_bad_arguments() -> None:
    with pytest.raises(SystemExit):
        cpu_gemm.main([])
    with pytest.raises(SystemExit):
        cpu_gemm.main(["--bench", "--m", "0"])
