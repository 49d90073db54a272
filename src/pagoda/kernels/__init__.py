"""Optional native kernels; each falls back to plain PyTorch where it cannot run."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# Imported on first use, so `python -m pagoda.kernels.cpu_gemv` runs the module only once.
_EXPORTS = ("MAX_M", "available", "linear", "linear_small_m", "unavailable_reason")
__all__ = ["MAX_M", "available", "linear", "linear_small_m", "unavailable_reason"]

if TYPE_CHECKING:
    from pagoda.kernels.cpu_gemv import MAX_M, available, linear, linear_small_m, unavailable_reason


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module("pagoda.kernels.cpu_gemv"), name)
    raise AttributeError(f"module 'pagoda.kernels' has no attribute {name!r}")
