"""Small-batch bf16 linear for CPU decode: an AVX-512 BF16 kernel compiled on first use.

With a few input rows (decode of a few sequences) a linear layer is bound by reading its
weight, and torch's bf16 matrix-vector path reaches only a fraction of memory bandwidth.
The kernel in `csrc/gemv_bf16.cpp` streams the weight once for all rows, accumulates in fp32
and splits output rows over torch's intra-op threads (`torch.get_num_threads()`).

The kernel is optional: `available()` is False (and `linear` / `linear_small_m` fall back to
`F.linear`) off Linux x86-64, on CPUs without AVX512-BF16, when `PAGODA_DISABLE_CPU_KERNELS=1`,
or when compiling fails (logged once). The build is cached in torch's extension directory.

Benchmark: `python -m pagoda.kernels.cpu_gemv --bench`.
"""

from __future__ import annotations

import argparse
import functools
import logging
import math
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

MAX_M = 8
"""Most input rows per kernel call (its accumulators live in registers); larger batches are
GEMM-bound, where `F.linear` does well, so `linear` sends them there."""

DISABLE_ENV = "PAGODA_DISABLE_CPU_KERNELS"
_REQUIRED_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")
_SOURCE = Path(__file__).parent / "csrc" / "gemv_bf16.cpp"
_CFLAGS = ["-O3", "-mavx512f", "-mavx512bf16", "-mavx512bw", "-mavx512vl", "-mfma", "-fopenmp"]

KernelFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def unavailable_reason() -> str | None:
    """Why the kernel cannot be used here without compiling it, or None if it may be."""
    if os.environ.get(DISABLE_ENV, "").strip().lower() in {"1", "true", "yes", "on"}:
        return f"disabled by {DISABLE_ENV}"
    if not sys.platform.startswith("linux") or platform.machine().lower() not in {"x86_64", "amd64"}:
        return f"needs Linux on x86-64, running {sys.platform} on {platform.machine()}"
    missing = [flag for flag in _REQUIRED_CPU_FLAGS if flag not in _cpu_flags()]
    if missing:
        return f"CPU lacks {', '.join(missing)}"
    return None


def _build_extension() -> KernelFn | None:
    """The compiled kernel, or None where it cannot run; raises if compiling fails."""
    reason = unavailable_reason()
    if reason is not None:
        logger.debug("CPU bf16 GEMV kernel not used: %s", reason)
        return None
    from torch.utils.cpp_extension import load

    load(
        name="pagoda_cpu_gemv",
        sources=[str(_SOURCE)],
        extra_cflags=_CFLAGS,
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
        verbose=False,
    )
    return torch.ops.pagoda_cpu.linear_small_m


class _LazyKernel:
    """Resolves a kernel on first use, once per process, from any thread."""

    def __init__(self, build: Callable[[], KernelFn | None]) -> None:
        self._build = build
        self._lock = threading.Lock()
        self._resolved = False
        self._fn: KernelFn | None = None

    def get(self) -> KernelFn | None:
        if self._resolved:
            return self._fn
        with self._lock:
            if not self._resolved:
                try:
                    self._fn = self._build()
                except Exception as exc:  # any build failure must leave pagoda working on F.linear
                    logger.warning(
                        "CPU bf16 GEMV kernel unavailable, using F.linear: build failed: %.2000s", exc
                    )
                self._resolved = True
        return self._fn


# The environment and CPU are checked once, at first use, like the build itself.
_KERNEL = _LazyKernel(_build_extension)


def available() -> bool:
    """True if the kernel runs here; compiles it on the first call (seconds, cached across runs)."""
    return _KERNEL.get() is not None


def _needs_grad(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )


def linear_small_m(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight.T + bias` for bf16 CPU tensors, x of shape [M, K] with 1 <= M <= MAX_M.

    Accumulates in fp32 and rounds once to bf16. Uses `F.linear` when the kernel is unavailable.
    """
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"x and weight must be 2-D, got shapes {tuple(x.shape)} and {tuple(weight.shape)}")
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"x has {k} features but weight has shape {tuple(weight.shape)}")
    if not 1 <= m <= MAX_M:
        raise ValueError(f"x must have 1 to {MAX_M} rows, got {m}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias must have shape ({n},), got {tuple(bias.shape)}")
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t is not None and (t.dtype != torch.bfloat16 or not t.is_cpu):
            raise ValueError(f"{name} must be a bfloat16 CPU tensor, got {t.dtype} on {t.device}")
    if _needs_grad(x, weight, bias):
        raise ValueError("linear_small_m does not support autograd; call it under torch.no_grad()")
    fn = _KERNEL.get()
    if fn is None:
        return F.linear(x, weight, bias)
    return _call(fn, x, weight, bias)


def _call(fn: KernelFn, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    return fn(x.contiguous(), weight, None if bias is None else bias.contiguous())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, routed to the kernel when it applies: bf16 CPU tensors, at most MAX_M rows, no grad."""
    fn = _KERNEL.get()
    if (
        fn is None
        or x.dtype != torch.bfloat16
        or weight.dtype != torch.bfloat16
        or (bias is not None and bias.dtype != torch.bfloat16)
        or not (x.is_cpu and weight.is_cpu)
        or weight.dim() != 2
        or x.dim() == 0
        or x.shape[-1] != weight.shape[1]
        or _needs_grad(x, weight, bias)
    ):
        return F.linear(x, weight, bias)
    if x.dim() == 2:
        return _call(fn, x, weight, bias) if 1 <= x.shape[0] <= MAX_M else F.linear(x, weight, bias)
    if not 1 <= math.prod(x.shape[:-1]) <= MAX_M:
        return F.linear(x, weight, bias)
    out = _call(fn, x.reshape(-1, x.shape[-1]), weight, bias)
    return out.reshape(*x.shape[:-1], weight.shape[0])


# ---------------------------------------------------------------------------------------------
# Benchmark

# (name, N, K) of Qwen2.5-0.5B's linear layers; "lm_head" is its real vocabulary.
QWEN25_05B_SHAPES = (
    ("qkv", 1152, 896),
    ("o", 896, 896),
    ("gate_up", 9728, 896),
    ("down", 896, 4864),
    ("lm_head_32k", 32000, 896),
    ("lm_head", 151936, 896),
)
QWEN25_05B_LAYERS = 24


def _times(fns: dict[str, Callable[[], object]], rounds: int, inner: int, stat: str) -> dict[str, float]:
    """Seconds per call (median or min over rounds); candidates alternate within each round."""
    for fn in fns.values():
        for _ in range(3):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            samples[name].append((time.perf_counter() - start) / inner)
    reduce = min if stat == "min" else statistics.median
    return {name: reduce(values) for name, values in samples.items()}


def _alternatives(x: torch.Tensor, w: torch.Tensor) -> dict[str, Callable[[], object]]:
    """Torch built-ins worth comparing at M=1: fp32 weights and oneDNN's prepacked bf16 linear."""
    xf, wf = x.float(), w.float()
    alts: dict[str, Callable[[], object]] = {"fp32": lambda: F.linear(xf, wf)}
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, x.shape[0])
        torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        alts["onednn"] = lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except (AttributeError, RuntimeError) as exc:
        print(f"  (oneDNN prepacked linear unavailable: {exc})")
    return alts


def bench(ms: list[int], rounds: int, with_alternatives: bool, stat: str = "median") -> None:
    fn = _KERNEL.get()
    if fn is None:
        raise SystemExit(f"kernel unavailable: {unavailable_reason() or 'build failed (see log)'}")
    print(f"threads={torch.get_num_threads()} rounds={rounds} stat={stat} (GB/s counts weight bytes)")
    totals: dict[int, tuple[float, float]] = {}
    for m in ms:
        t_torch_model = t_ours_model = 0.0
        for name, n, k in QWEN25_05B_SHAPES:
            w = torch.randn(n, k, dtype=torch.bfloat16)
            x = torch.randn(m, k, dtype=torch.bfloat16)
            fns: dict[str, Callable[[], object]] = {
                "F.linear": lambda x=x, w=w: F.linear(x, w),
                "kernel": lambda x=x, w=w: fn(x, w, None),
            }
            if with_alternatives and m == 1:
                fns.update(_alternatives(x, w))
            inner = max(1, min(20, int(2e7 // (n * k))))
            big = n * k > 5e7
            times = _times(fns, rounds=max(5, rounds // 3) if big else rounds, inner=inner, stat=stat)
            gb = n * k * 2 / 1e9
            cols = "  ".join(f"{label} {t * 1e6:8.1f}us {gb / t:5.1f}GB/s" for label, t in times.items())
            print(f"M={m} {name:<12} {cols}  speedup x{times['F.linear'] / times['kernel']:.2f}", flush=True)
            if name == "lm_head_32k":
                continue
            count = 1 if name == "lm_head" else QWEN25_05B_LAYERS
            t_torch_model += count * times["F.linear"]
            t_ours_model += count * times["kernel"]
        totals[m] = (t_torch_model, t_ours_model)
    print(f"Whole-model linear time per decode step (Qwen2.5-0.5B: {QWEN25_05B_LAYERS} layers + lm_head):")
    for m, (t_torch, t_ours) in totals.items():
        print(
            f"  M={m}: F.linear {t_torch * 1e3:7.2f}ms  kernel {t_ours * 1e3:7.2f}ms  "
            f"speedup x{t_torch / t_ours:.2f}  ({m / t_torch:6.1f} -> {m / t_ours:6.1f} tok/s bound)"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pagoda.kernels.cpu_gemv", description=__doc__)
    parser.add_argument("--bench", action="store_true", help="time the kernel against F.linear")
    parser.add_argument("--m", default="1,2,4,8", help="comma-separated row counts (default 1,2,4,8)")
    parser.add_argument("--rounds", type=int, default=21, help="timed rounds per shape (default 21)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--stat", choices=("median", "min"), default="median", help="per-call statistic")
    parser.add_argument("--alternatives", action="store_true", help="also time fp32 and oneDNN at M=1")
    args = parser.parse_args(argv)
    if not args.bench:
        parser.error("nothing to do: pass --bench")
    try:
        ms = [int(v) for v in args.m.split(",")]
    except ValueError:
        parser.error(f"--m must be comma-separated integers, got {args.m!r}")
    if any(not 1 <= m <= MAX_M for m in ms):
        parser.error(f"--m values must be in 1..{MAX_M}")
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    if args.threads is not None:
        if args.threads < 1:
            parser.error("--threads must be >= 1")
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO)
    bench(ms, rounds=args.rounds, with_alternatives=args.alternatives, stat=args.stat)


if __name__ == "__main__":
    main()
