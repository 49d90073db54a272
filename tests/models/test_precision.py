"""kernels/precision.py: bf16 matmuls outside the kernels upcast to fp32 only where bf16 is slow."""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels import precision


@pytest.mark.parametrize(
    ("caps", "vendor", "upcast"),
    [
        ({"amx_bf16": True, "avx512_bf16": True}, "GenuineIntel", False),  # Sapphire Rapids and later
        ({"avx512_bf16": True}, "AuthenticAMD", False),  # Zen 4: full-rate vdpbf16ps
        ({"avx512_bf16": True}, "GenuineIntel", True),  # half-rate dot product, no AMX
        ({"avx512_bf16": False}, "GenuineIntel", True),  # Ice Lake and older
        ({}, "AuthenticAMD", True),  # Zen 1-3
    ],
)
def test_upcast_only_where_bf16_is_slow(monkeypatch, caps, vendor, upcast) -> None:
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: caps)
    monkeypatch.setattr(precision, "_cpu_vendor", lambda: vendor)
    precision.cpu_lacks_full_rate_bf16.cache_clear()
    try:
        x = torch.zeros(1, dtype=torch.bfloat16)
        assert precision.upcast_to_fp32(x, precision.FP32_MIN_ROWS) is upcast
        assert not precision.upcast_to_fp32(x, precision.FP32_MIN_ROWS - 1)
        assert not precision.upcast_to_fp32(x.float(), 10 * precision.FP32_MIN_ROWS)
    finally:
        precision.cpu_lacks_full_rate_bf16.cache_clear()
