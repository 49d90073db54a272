"""The compute peak probe (csrc/compute_peak.cpp, pagoda.kernels.peak) on every variant: the
kinds each variant runs, the multiply-accumulates it reports for a run, and bad arguments
rejected. (Its rates are timings: `python -m pagoda.quant.kernel_bench` reports them.)"""

from __future__ import annotations

import time

import pytest
import torch

from pagoda.kernels import build, peak

# 32-bit lanes per register and multiply-accumulates per lane and instruction.
_LANES = {"avx2": 8, "avx512": 16, "avx512_bf16": 16}
_PER_LANE = {"fp32_fma": 1, "bf16_dot": 2}


def _int8_per_lane(variant: str) -> int:
    vnni = "avx512_vnni" if variant != "avx2" else "avx_vnni"
    return 4 if vnni in build.ops().quant_dot_kinds() else 2  # vpdpbusd, else vpmaddubsw


def test_kinds_per_variant(variant: str) -> None:
    kinds = peak.kinds()
    assert kinds == (
        ["fp32_fma", "bf16_dot", "int8_dot"] if variant == "avx512_bf16" else ["fp32_fma", "int8_dot"]
    )
    assert peak.bf16_kind() == ("bf16_dot" if variant == "avx512_bf16" else "fp32_fma")


@pytest.mark.parametrize("threads", [1, 2])
def test_reported_work_is_every_threads_chains(variant: str, threads: int) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for kind in peak.kinds():
            per_lane = _int8_per_lane(variant) if kind == "int8_dot" else _PER_LANE[kind]
            steps = 1000
            macs = build.ops().dot_peak(kind, steps)
            assert macs == threads * steps * 12 * _LANES[variant] * per_lane, kind
            assert peak.measure_gmac_s(kind, steps=steps, repeats=2) > 0
            assert peak.measure_gmac_s(kind, steps=steps, repeats=1, clock=time.process_time) > 0
    finally:
        torch.set_num_threads(before)


def test_bad_arguments_are_rejected(variant: str) -> None:
    with pytest.raises(ValueError, match="unknown peak kind"):
        peak.measure_gmac_s("fp64_fma")
    with pytest.raises(ValueError, match="steps"):
        peak.measure_gmac_s("fp32_fma", steps=0)
    with pytest.raises(ValueError, match="repeats"):
        peak.measure_gmac_s("fp32_fma", repeats=0)
    with pytest.raises(RuntimeError, match="unknown kind"):
        build.ops().dot_peak("fp64_fma", 10)
    with pytest.raises(RuntimeError, match="steps"):
        build.ops().dot_peak("fp32_fma", 0)
    if variant != "avx512_bf16":
        with pytest.raises(RuntimeError, match="unknown kind"):
            build.ops().dot_peak("bf16_dot", 10)


def test_without_kernels_the_probe_says_so() -> None:
    with build.use_variant(None):
        assert peak.kinds() == []
        with pytest.raises(RuntimeError, match="needs the CPU kernels"):
            peak.measure_gmac_s("fp32_fma")
