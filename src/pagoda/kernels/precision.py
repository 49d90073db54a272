"""When a bfloat16 matmul runs faster in float32 on the CPU.

Without AMX, oneDNN's bfloat16 GEMM and attention kernels reach only about 60% of float32 speed on
AVX-512 CPUs (one core: `[2048, 896] @ [896, 9728]` takes 450 ms in bf16 and 270 ms in fp32; causal
attention over 2048 tokens 135 ms vs 81 ms). From a few hundred rows on, upcasting the operands
costs far less than it saves. The float32 product of bf16 operands, rounded back to bf16, equals
the bf16 kernel's result (which also accumulates in float32) up to summation order.
"""

from __future__ import annotations

import functools

import torch

# Below this many rows the upcast (and the weight copy it needs) costs more than it saves.
FP32_MIN_ROWS = 256


@functools.cache
def _cpu_lacks_amx_bf16() -> bool:
    get_capabilities = getattr(torch.cpu, "get_capabilities", None)
    if get_capabilities is None:
        return False
    return not get_capabilities().get("amx_bf16", False)


def upcast_to_fp32(x: torch.Tensor, rows: int) -> bool:
    """Whether a matmul with `rows` rows on `x`'s device and dtype should run in float32."""
    return (
        x.dtype == torch.bfloat16
        and x.device.type == "cpu"
        and rows >= FP32_MIN_ROWS
        and _cpu_lacks_amx_bf16()
    )
