"""Arithmetic peak, measured: the ceiling of batches and prefill, whose GEMMs are bound by the
multiply-accumulates a core issues, not by memory (`pagoda.quant.kernel_bench` states its
kernels' rates as a share of it, as it states decode's against `pagoda.kernels.bandwidth`).

The probe (`csrc/compute_peak.cpp`) runs 12 independent chains of one instruction on every torch
thread, nothing else: `fp32_fma` (the bf16 kernel's dot product on CPUs without AVX512-BF16),
`bf16_dot` (vdpbf16ps, with it) and `int8_dot` (the quantized kernels' integer dot product:
vpdpbusd with VNNI, else vpmaddubsw, an upper bound there). The best of a few timed runs is the
rate the hardware allows.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from pagoda.kernels import build

DEFAULT_STEPS = 10_000_000
DEFAULT_REPEATS = 5


def kinds() -> list[str]:
    """The instructions the probe runs in the kernel variant in use ([] without kernels)."""
    return list(build.ops().dot_peak_kinds()) if build.available() else []


def bf16_kind() -> str:
    """The instruction pagoda's bf16 kernel multiplies with in this variant."""
    return "bf16_dot" if "bf16_dot" in kinds() else "fp32_fma"


def measure_gmac_s(
    kind: str,
    steps: int = DEFAULT_STEPS,
    repeats: int = DEFAULT_REPEATS,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Multiply-accumulates per second (1e9, all torch threads) of `kind`, best of `repeats`,
    timed by `clock` (a caller timing its kernels in process CPU time passes that)."""
    if not build.available():
        raise RuntimeError("the compute peak probe needs the CPU kernels (pagoda.kernels.build)")
    if kind not in kinds():
        raise ValueError(f"unknown peak kind {kind!r} for this kernel variant; one of {kinds()}")
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive integer, got {repeats!r}")
    op = build.ops().dot_peak
    op(kind, max(1, steps // 10))  # warm-up: wakes the threads, settles the clock
    best = 0.0
    for _ in range(repeats):
        start = clock()
        macs = op(kind, steps)
        best = max(best, macs / max(clock() - start, 1e-9) / 1e9)
    return best
