"""Builds pagoda's CPU kernels (`csrc/`) on first use, once per process, where they can run.

The kernels need Linux on x86-64 with AVX512-BF16 (for `vcvtneps2bf16`); `available()` is False
elsewhere, when `PAGODA_DISABLE_CPU_KERNELS=1`, or when compiling fails (logged once), and every
caller then keeps to plain PyTorch. The build is cached in torch's extension directory, so only
the first run on a machine pays the compile (seconds).
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import sys
import threading
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

DISABLE_ENV = "PAGODA_DISABLE_CPU_KERNELS"
_REQUIRED_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16")
_CSRC = Path(__file__).parent / "csrc"
_SOURCES = ("gemm_bf16.cpp", "decode_ops.cpp")
_CFLAGS = ["-O3", "-mavx512f", "-mavx512bf16", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-fopenmp"]


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
    """Why the kernels cannot be used here without compiling them, or None if they may be."""
    if os.environ.get(DISABLE_ENV, "").strip().lower() in {"1", "true", "yes", "on"}:
        return f"disabled by {DISABLE_ENV}"
    if not sys.platform.startswith("linux") or platform.machine().lower() not in {"x86_64", "amd64"}:
        return f"needs Linux on x86-64, running {sys.platform} on {platform.machine()}"
    missing = [flag for flag in _REQUIRED_CPU_FLAGS if flag not in _cpu_flags()]
    if missing:
        return f"CPU lacks {', '.join(missing)}"
    return None


def _build() -> bool:
    """True once the ops are registered; False where they cannot run; raises if compiling fails."""
    reason = unavailable_reason()
    if reason is not None:
        logger.debug("CPU kernels not used: %s", reason)
        return False
    from torch.utils.cpp_extension import load

    load(
        name="pagoda_cpu_kernels",
        sources=[str(_CSRC / name) for name in _SOURCES],
        extra_cflags=_CFLAGS,
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
        verbose=False,
    )
    return True


class LazyBuild:
    """Runs `build` on first use, once per process, from any thread."""

    def __init__(self, build: Callable[[], bool]) -> None:
        self._build = build
        self._lock = threading.Lock()
        self._resolved = False
        self._ok = False

    def get(self) -> bool:
        if self._resolved:
            return self._ok
        with self._lock:
            if not self._resolved:
                try:
                    self._ok = self._build()
                except Exception as exc:  # a failed build must leave pagoda working on plain torch
                    logger.warning("CPU kernels unavailable, using plain PyTorch: build failed: %.2000s", exc)
                self._resolved = True
        return self._ok


_KERNELS = LazyBuild(_build)


def available() -> bool:
    """True if the kernels run here; compiles them on the first call."""
    return _KERNELS.get()
