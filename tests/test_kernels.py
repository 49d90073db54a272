"""The small-M bf16 CPU linear kernel against an fp32-accumulated reference, and its fallbacks."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch
import torch.nn.functional as F

from pagoda.kernels import cpu_gemv

requires_kernel = pytest.mark.skipif(
    not cpu_gemv.available(),
    reason=f"CPU bf16 GEMV kernel unavailable: {cpu_gemv.unavailable_reason() or 'build failed'}",
)


def _make(m: int, n: int, k: int, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    return x, w, b


def _assert_close_to_fp32(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """y must be the fp32 result rounded to bf16: within half a bf16 ulp plus fp32 summation error."""
    ref = x.float() @ w.float().T
    if b is not None:
        ref = ref + b.float()
    assert y.dtype == torch.bfloat16
    assert y.shape == ref.shape
    abs_sum = x.float().abs() @ w.float().abs().T
    tol = ref.abs() * 2.0**-8 + abs_sum * 2.0**-16 + 1e-30
    err = (y.float() - ref).abs()
    assert torch.all(err <= tol), f"max error {err.max().item()} exceeds bf16 rounding"


@requires_kernel
@pytest.mark.parametrize("m", range(1, cpu_gemv.MAX_M + 1))
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("n", "k"), [(37, 100), (1, 31), (19, 32), (8, 64), (11, 1), (5, 0), (1152, 896)])
def test_kernel_matches_fp32_reference(m: int, n: int, k: int, bias: bool) -> None:
    x, w, b = _make(m, n, k, bias)
    _assert_close_to_fp32(cpu_gemv.linear_small_m(x, w, b), x, w, b)


@requires_kernel
@pytest.mark.parametrize("m", [1, 3, 8])
def test_kernel_parallel_split_matches_single_thread(m: int) -> None:
    # Large enough to be split over threads; every row's sum order is fixed, so results are equal.
    x, w, b = _make(m, 4099, 300, bias=True)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = cpu_gemv.linear_small_m(x, w, b)
        torch.set_num_threads(max(2, before))
        multi = cpu_gemv.linear_small_m(x, w, b)
    finally:
        torch.set_num_threads(before)
    _assert_close_to_fp32(multi, x, w, b)
    assert torch.equal(single, multi)


@requires_kernel
def test_kernel_accepts_strided_inputs() -> None:
    x, w, b = _make(4, 67, 130, bias=True)
    x_cols = torch.zeros(4, 260, dtype=torch.bfloat16)
    x_cols[:, ::2] = x  # column stride 2
    x_t = x.T.contiguous().T  # column-major
    w_rows = torch.zeros(67, 200, dtype=torch.bfloat16)
    w_rows[:, :130] = w  # row stride 200, unit column stride
    w_cols = w.T.contiguous().T  # column-major weight is copied
    b_strided = torch.zeros(134, dtype=torch.bfloat16)
    b_strided[::2] = b
    expected = cpu_gemv.linear_small_m(x, w, b)
    for xi, wi, bi in [
        (x_cols[:, ::2], w, b),
        (x_t, w, b),
        (x, w_rows[:, :130], b),
        (x, w_cols, b),
        (x, w, b_strided[::2]),
    ]:
        assert torch.equal(cpu_gemv.linear_small_m(xi, wi, bi), expected)


@requires_kernel
def test_kernel_runs_in_inference_mode_with_trainable_weight() -> None:
    x, w, b = _make(2, 21, 40, bias=True)
    expected = cpu_gemv.linear_small_m(x, w, b)
    with torch.inference_mode():
        assert torch.equal(cpu_gemv.linear_small_m(x, w.clone().requires_grad_(), b), expected)


@requires_kernel
def test_linear_dispatcher_uses_kernel_for_small_bf16_batches() -> None:
    x, w, b = _make(6, 45, 70, bias=True)
    out = cpu_gemv.linear(x.reshape(2, 3, 70), w, b)
    assert out.shape == (2, 3, 45)
    assert torch.equal(out.reshape(6, 45), cpu_gemv.linear_small_m(x, w, b))
    vector_out = cpu_gemv.linear(x[0], w, b)
    assert vector_out.shape == (45,)
    assert torch.equal(vector_out, cpu_gemv.linear_small_m(x[:1], w, b)[0])


def test_linear_dispatcher_falls_back_to_f_linear() -> None:
    x, w, b = _make(cpu_gemv.MAX_M + 1, 33, 40, bias=True)
    assert torch.equal(cpu_gemv.linear(x, w, b), F.linear(x, w, b))  # too many rows
    xf, wf, bf = x.float(), w.float(), b.float()
    assert torch.equal(cpu_gemv.linear(xf[:2], wf, bf), F.linear(xf[:2], wf, bf))  # not bf16
    empty = torch.zeros(0, 40, dtype=torch.bfloat16)
    assert cpu_gemv.linear(empty, w, b).shape == (0, 33)
    w_grad = w.clone().requires_grad_()
    out = cpu_gemv.linear(x[:2], w_grad, b)
    assert out.requires_grad  # autograd-tracked inputs go through F.linear


def test_disabled_by_environment_uses_f_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_gemv.DISABLE_ENV, "1")
    # The environment is read once per process, at first use: start from a fresh, unresolved kernel.
    monkeypatch.setattr(cpu_gemv, "_KERNEL", cpu_gemv._LazyKernel(cpu_gemv._build_extension))
    assert cpu_gemv.DISABLE_ENV in (cpu_gemv.unavailable_reason() or "")
    assert not cpu_gemv.available()
    x, w, b = _make(3, 29, 50, bias=True)
    assert torch.equal(cpu_gemv.linear_small_m(x, w, b), F.linear(x, w, b))
    assert torch.equal(cpu_gemv.linear(x, w, b), F.linear(x, w, b))


def test_build_failure_is_logged_once_and_disables(caplog: pytest.LogCaptureFixture) -> None:
    calls = []

    def failing_build():
        calls.append(1)
        raise RuntimeError("no compiler")

    kernel = cpu_gemv._LazyKernel(failing_build)
    with caplog.at_level(logging.WARNING, logger=cpu_gemv.__name__):
        assert kernel.get() is None
        assert kernel.get() is None
    assert len(calls) == 1
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "no compiler" in warnings[0].getMessage()


def test_build_runs_once_across_threads() -> None:
    calls = []

    def slow_build():
        calls.append(1)
        time.sleep(0.05)
        return F.linear

    kernel = cpu_gemv._LazyKernel(slow_build)
    results = []
    threads = [threading.Thread(target=lambda: results.append(kernel.get())) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert results == [F.linear] * 8


@pytest.mark.parametrize(
    ("x_shape", "w_shape", "b_shape", "dtype", "match"),
    [
        ((4,), (3, 4), None, torch.bfloat16, "2-D"),
        ((2, 4), (3, 5), None, torch.bfloat16, "features"),
        ((0, 4), (3, 4), None, torch.bfloat16, "rows"),
        ((cpu_gemv.MAX_M + 1, 4), (3, 4), None, torch.bfloat16, "rows"),
        ((2, 4), (3, 4), (4,), torch.bfloat16, "bias"),
        ((2, 4), (3, 4), None, torch.float32, "bfloat16"),
    ],
)
def test_linear_small_m_rejects_bad_input(x_shape, w_shape, b_shape, dtype, match) -> None:
    x = torch.zeros(x_shape, dtype=dtype)
    w = torch.zeros(w_shape, dtype=dtype)
    b = None if b_shape is None else torch.zeros(b_shape, dtype=dtype)
    with pytest.raises(ValueError, match=match):
        cpu_gemv.linear_small_m(x, w, b)


def test_linear_small_m_rejects_autograd() -> None:
    x, w, _ = _make(2, 3, 4, bias=False)
    with pytest.raises(ValueError, match="autograd"):
        cpu_gemv.linear_small_m(x, w.requires_grad_())


def test_bench_cli_rejects_bad_arguments() -> None:
    with pytest.raises(SystemExit):
        cpu_gemv.main([])
    with pytest.raises(SystemExit):
        cpu_gemv.main(["--bench", "--m", "0"])
