"""Helpers for running kernel code once per CPU kernel variant this machine can execute: on any
x86-64 CPU with AVX2 nothing skips; elsewhere tests skip, naming the reason."""

from __future__ import annotations

import pytest

from pagoda.kernels import build

RUNNABLE = build.supported_variants()
_NONE_REASON = f"no CPU kernel variant runs here: {build.platform_reason() or 'the CPU lacks AVX2 + FMA'}"

requires_variants = pytest.mark.skipif(not RUNNABLE, reason=_NONE_REASON)


def variant_params() -> list:
    """`pytest.mark.parametrize` values: the runnable variants, or one skipped entry."""
    return list(RUNNABLE) or [pytest.param(None, marks=pytest.mark.skip(reason=_NONE_REASON))]


def on_every_variant(fn):
    """`{variant: fn()}` for every runnable variant (for the bit-equality checks)."""
    results = {}
    for name in RUNNABLE:
        with build.use_variant(name):
            results[name] = fn()
    return results


def unresolved_selection(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """Forget this process's kernel choice (restored after the test), so that the next use
    chooses again under the test's environment (read once per process, at first use)."""
    monkeypatch.setattr(build, "_status", None)
    monkeypatch.setattr(build, "_active", None)
    monkeypatch.delenv(build.ISA_ENV, raising=False)
    return monkeypatch
