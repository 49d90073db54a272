"""When a bfloat16 matmul runs faster in float32 on the CPU.

oneDNN's bfloat16 GEMM and attention are only fast where the CPU multiplies bf16 at full rate:
with AMX, or on AMD Zen 4 and later, whose AVX512-BF16 dot product runs at twice the fp32
multiply-add rate (2 threads here: `[2048, 896] @ [896, 9728]` in 97 ms in bf16 against 241 ms
upcast to fp32; causal attention over 2048 tokens equal). Elsewhere they reach a fraction of
float32 speed: Intel cores without AMX run that dot product at half the rate of fp32
multiply-adds, and CPUs without AVX512-BF16 convert every operand (one core of the Intel machine
of round 1: the GEMM in 450 ms in bf16 and 270 ms in fp32; the attention 135 ms vs 81 ms). There,
from a few hundred rows on, upcasting the operands costs far less than it saves. The float32
product of bf16 operands, rounded back to bf16, equals the bf16 kernel's result (which also
accumulates in float32) up to summation order.

This only matters for matmuls that do not go to pagoda's own CPU kernels (`pagoda.kernels`):
prefill attention, and every linear layer where the kernels cannot run.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

# Below this many rows the upcast (and the weight copy it needs) costs more than it saves.
FP32_MIN_ROWS = 256


def _cpu_vendor() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return ""


@functools.cache
def cpu_lacks_full_rate_bf16() -> bool:
    """True where torch's CPU bf16 matmuls run slower than fp32 ones: no AMX, and no AVX512-BF16
    at full rate (AMD's)."""
    get_capabilities = getattr(torch.cpu, "get_capabilities", None)
    if get_capabilities is None:
        return False
    caps = get_capabilities()
    full_rate_dot = caps.get("avx512_bf16", False) and _cpu_vendor() == "AuthenticAMD"
    return not (caps.get("amx_bf16", False) or full_rate_dot)


def upcast_to_fp32(x: torch.Tensor, rows: int) -> bool:
    """Whether a matmul with `rows` rows on `x`'s device and dtype should run in float32."""
    return (
        x.dtype == torch.bfloat16
        and x.device.type == "cpu"
        and rows >= FP32_MIN_ROWS
        and cpu_lacks_full_rate_bf16()
    )
