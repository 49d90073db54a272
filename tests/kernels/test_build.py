"""Choosing, building and naming the kernel variants; PAGODA_CPU_ISA; every fallback to PyTorch."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch
import torch.nn.functional as F

from kernel_variants import RUNNABLE, requires_variants, unresolved_selection
from pagoda.kernels import build, cpu_gemm, cpu_ops
from pagoda.layers import Linear

AVX2_ONLY = frozenset({"sse4_2", "avx", "avx2", "fma"})
ZEN4 = AVX2_ONLY | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni"}


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    return unresolved_selection(monkeypatch)


def test_variants_follow_the_cpu_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build, "platform_reason", lambda: None)
    assert build.supported_variants(ZEN4) == ("avx512_bf16", "avx512", "avx2")
    assert build.supported_variants(ZEN4 - {"avx512_bf16"}) == ("avx512", "avx2")  # Ice Lake
    assert build.supported_variants(AVX2_ONLY) == ("avx2",)
    assert build.supported_variants(AVX2_ONLY - {"fma"}) == ()


def test_extension_names_carry_the_variant_and_the_sources(tmp_path, monkeypatch) -> None:
    names = {v: build.extension_name(v) for v in build.VARIANT_NAMES}
    assert all(name.startswith(f"pagoda_cpu_{v}_") for v, name in names.items())
    assert len(set(names.values())) == len(names)
    for src in build.sources():
        (tmp_path / src.name).write_bytes(src.read_bytes())
    for header in build._CSRC.glob("*.h"):
        (tmp_path / header.name).write_bytes(header.read_bytes())
    monkeypatch.setattr(build, "_CSRC", tmp_path)
    assert build.extension_name("avx2") == names["avx2"]  # the same text gives the same name
    header = tmp_path / "vec.h"
    header.write_text(header.read_text() + "\n// changed\n")
    assert build.extension_name("avx2") != names["avx2"]


def test_register_sources_checks_its_input_and_its_timing(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(build, "_loaded", {})  # nothing built yet
    monkeypatch.setattr(build, "_extra_sources", [])
    with pytest.raises(ValueError, match=r"not a \.cpp file"):
        build.register_sources(tmp_path / "missing.cpp")
    extra = tmp_path / "extra.cpp"
    extra.write_text("// an extra kernel file\n")
    before = build.extension_name("avx2")
    build.register_sources(extra)
    assert build.sources()[-1] == extra
    assert build.extension_name("avx2") != before
    monkeypatch.setattr(build, "_loaded", {"avx2": object()})
    with pytest.raises(RuntimeError, match="before any kernel variant is built"):
        build.register_sources(extra)


@requires_variants
def test_the_fastest_supported_variant_is_chosen_and_logged(fresh, caplog) -> None:
    with caplog.at_level(logging.INFO, logger=build.__name__):
        st = build.status()
    assert st.kind == "ok" and st.variant == RUNNABLE[0] and not st.forced
    assert st.supported == RUNNABLE and st.reason is None
    assert build.available() and build.ops() is getattr(torch.ops, f"pagoda_{RUNNABLE[0]}")
    [record] = [r for r in caplog.records if r.name == build.__name__]
    assert record.levelno == logging.INFO and RUNNABLE[0] in record.getMessage()


@requires_variants
@pytest.mark.parametrize("variant", RUNNABLE)
def test_the_environment_forces_a_variant(fresh, variant: str) -> None:
    fresh.setenv(build.ISA_ENV, variant.upper())
    st = build.status()
    assert st.variant == variant and st.forced and f"forced by {build.ISA_ENV}" in st.describe()
    assert build.ops() is getattr(torch.ops, f"pagoda_{variant}")


@pytest.mark.parametrize("value", ["avx1024", "sse2", "native"])
def test_an_unknown_variant_is_a_clear_error(fresh, value: str) -> None:
    fresh.setenv(build.ISA_ENV, value)
    assert build.status().kind == "invalid-setting"
    with pytest.raises(
        ValueError, match=rf"{build.ISA_ENV}='{value}' is not one of avx512_bf16, avx512, avx2, none"
    ):
        build.available()
    with pytest.raises(ValueError, match=build.ISA_ENV):
        Linear(8, 4, False, torch.bfloat16).process_weights_after_loading()


def test_a_variant_the_cpu_cannot_run_is_a_clear_error(fresh) -> None:
    fresh.setattr(build, "platform_reason", lambda: None)
    fresh.setattr(build, "cpu_flags", lambda: AVX2_ONLY)
    fresh.setenv(build.ISA_ENV, "avx512_bf16")
    with pytest.raises(
        ValueError,
        match=r"avx512_bf16 cannot run here: this CPU lacks avx512f, .*avx512_bf16 \(this machine can run: avx2\)",
    ):
        build.available()
    with pytest.raises(ValueError, match="cannot run here"):
        build.load_variant("avx512")
    with pytest.raises(ValueError, match="unknown kernel variant"):
        build.load_variant("neon")


def test_disabled_by_the_environment(fresh, caplog) -> None:
    fresh.setenv(build.ISA_ENV, "none")
    with caplog.at_level(logging.INFO, logger=build.__name__):
        assert not build.available()
    st = build.status()
    assert st.kind == "disabled" and st.variant is None and "PAGODA_CPU_ISA=none" in st.reason
    assert [r.levelno for r in caplog.records if r.name == build.__name__] == [logging.INFO]
    assert not cpu_ops.applies(torch.zeros(1, dtype=torch.bfloat16))
    layer = Linear(8, 4, True, torch.bfloat16)
    for param in layer.parameters():
        param.copy_(torch.randn(param.shape))
    layer.process_weights_after_loading()
    assert layer.packed is None
    x = torch.randn(3, 8).bfloat16()
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    with pytest.raises(RuntimeError, match="unavailable: disabled by PAGODA_CPU_ISA=none"):
        cpu_gemm.pack(layer.weight)


@pytest.mark.parametrize(
    ("setup", "kind", "reason"),
    [
        (lambda m: m.setattr(build.platform, "machine", lambda: "aarch64"), "unsupported-platform", "x86-64"),
        (
            lambda m: m.setattr(build, "cpu_flags", lambda: frozenset({"sse4_2", "avx"})),
            "unsupported-cpu",
            "AVX2",
        ),
        (lambda m: m.setenv("CXX", "no-such-compiler-xyz"), "no-compiler", "no-such-compiler-xyz"),
    ],
)
def test_each_fallback_is_one_warning_naming_its_reason(fresh, caplog, setup, kind, reason) -> None:
    if kind != "unsupported-platform":
        fresh.setattr(build, "platform_reason", lambda: None)
    if kind == "no-compiler":
        fresh.setattr(build, "cpu_flags", lambda: AVX2_ONLY)
        fresh.setattr(build, "_loaded", {})  # nothing built in this process yet
    setup(fresh)
    with caplog.at_level(logging.INFO, logger=build.__name__):
        assert not build.available()
        assert not build.available()
    st = build.status()
    assert st.kind == kind and reason in st.reason and st.variant is None
    records = [r for r in caplog.records if r.name == build.__name__]
    assert [r.levelno for r in records] == [logging.WARNING]
    assert reason in records[0].getMessage() and "plain PyTorch" in records[0].getMessage()


def test_a_failed_compile_is_a_warning_not_a_crash(fresh, caplog) -> None:
    def failing(variant):
        raise build.BuildError("compile-error", f"compiling the {variant} kernels failed: error: boom")

    fresh.setattr(build, "platform_reason", lambda: None)
    fresh.setattr(build, "cpu_flags", lambda: AVX2_ONLY)
    fresh.setattr(build, "load_variant", failing)
    with caplog.at_level(logging.WARNING, logger=build.__name__):
        assert not build.available()
    st = build.status()
    assert st.kind == "compile-error" and "boom" in st.reason
    [record] = [r for r in caplog.records if r.name == build.__name__]
    assert record.levelno == logging.WARNING and "boom" in record.getMessage()
    with pytest.raises(RuntimeError, match="boom"):
        build.ops()


def test_the_choice_is_made_once_across_threads(fresh) -> None:
    calls = []

    def slow_select():
        calls.append(1)
        time.sleep(0.05)
        return build.KernelStatus("disabled", reason="test"), None

    fresh.setattr(build, "_select", slow_select)
    results = []
    threads = [threading.Thread(target=lambda: results.append(build.available())) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and results == [False] * 8


@requires_variants
def test_use_variant_switches_and_restores(fresh) -> None:
    engine_choice = build.ops()
    with build.use_variant(RUNNABLE[-1]):
        assert build.ops() is getattr(torch.ops, f"pagoda_{RUNNABLE[-1]}")
        with build.use_variant(None):
            assert not build.available()
    assert build.ops() is engine_choice
