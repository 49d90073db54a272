"""`pagoda info`: the kernel variant in use or exactly why none, versions, CPU, threads, bandwidth."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from kernel_variants import RUNNABLE, requires_variants, unresolved_selection
from pagoda.entrypoints.cli import main
from pagoda.kernels import build
from server_utils import SRC_DIR


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    return unresolved_selection(monkeypatch)


def _info(capsys, *flags: str) -> dict:
    assert main(["info", "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)


@requires_variants
def test_reports_the_variant_in_use(fresh, capsys) -> None:
    info = _info(capsys)
    assert info["kernels"]["variant"] == RUNNABLE[0] and info["kernels"]["status"] == "ok"
    assert info["kernels"]["supported_variants"] == list(RUNNABLE) and info["kernels"]["reason"] is None
    assert info["torch"] == torch.__version__ and info["pagoda"]
    assert info["cpu_flags"]["avx2"] is True and info["threads"]["torch"] == torch.get_num_threads()
    assert "bandwidth" not in info
    assert main(["info"]) == 0
    text = capsys.readouterr().out
    assert f"kernel variant  {RUNNABLE[0]} (" in text and "cpu flags" in text and "threads" in text


@requires_variants
def test_reports_a_forced_variant(fresh, capsys) -> None:
    fresh.setenv(build.ISA_ENV, RUNNABLE[-1])
    kernels = _info(capsys)["kernels"]
    assert kernels["variant"] == RUNNABLE[-1] and kernels["forced"]


@pytest.mark.parametrize(
    ("env", "setup", "status", "reason"),
    [
        ("none", None, "disabled", "disabled by PAGODA_CPU_ISA=none"),
        ("avx9", None, "invalid-setting", "PAGODA_CPU_ISA='avx9' is not one of"),
        (
            None,
            lambda m: m.setattr(build.platform, "machine", lambda: "arm64"),
            "unsupported-platform",
            "x86-64",
        ),
        (
            None,
            lambda m: m.setattr(build, "cpu_flags", lambda: frozenset({"avx"})),
            "unsupported-cpu",
            "AVX2",
        ),
        (None, lambda m: m.setenv("CXX", "no-such-cxx"), "no-compiler", "no-such-cxx"),
        (
            None,
            lambda m: m.setattr(
                build,
                "load_variant",
                lambda v: (_ for _ in ()).throw(build.BuildError("compile-error", "error: x")),
            ),
            "compile-error",
            "error: x",
        ),
    ],
)
def test_reports_exactly_why_no_variant_runs(fresh, capsys, env, setup, status, reason) -> None:
    if env is not None:
        fresh.setenv(build.ISA_ENV, env)
    if status in ("unsupported-cpu", "no-compiler", "compile-error"):
        fresh.setattr(build, "platform_reason", lambda: None)
        fresh.setattr(build, "cpu_flags", lambda: frozenset({"avx", "avx2", "fma"}))
        fresh.setattr(build, "_loaded", {})
    if setup is not None:
        setup(fresh)
    kernels = _info(capsys)["kernels"]
    assert kernels["variant"] is None and kernels["status"] == status and reason in kernels["reason"]
    assert main(["info"]) == 0
    assert f"kernel variant  none ({kernels['reason']})" in capsys.readouterr().out


def test_measures_bandwidth(capsys) -> None:
    bandwidth = _info(capsys, "--bandwidth-mb", "32")["bandwidth"]
    assert bandwidth["best_gb_s"] >= bandwidth["median_gb_s"] > 0 and bandwidth["buffer_mb"] == 32
    assert main(["info", "--bandwidth-mb", "0"]) == 2


def test_the_command_reports_disabled_kernels() -> None:
    env = {**os.environ, "PAGODA_CPU_ISA": "none", "PYTHONPATH": SRC_DIR}
    out = subprocess.run(
        [sys.executable, "-m", "pagoda.entrypoints.cli", "info"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "kernel variant  none (disabled by PAGODA_CPU_ISA=none)" in out.stdout
    assert "pagoda          " in out.stdout and "torch" in out.stdout
