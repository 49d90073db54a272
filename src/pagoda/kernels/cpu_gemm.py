"""bf16- and fp32-weight linear layers for x86-64 CPUs (AVX2 and up): a kernel compiled on first
use, over weights repacked once at load time.

`csrc/gemm_bf16.cpp` keeps the weight in bf16 (half the bytes of fp32 to stream) in panels of
16 columns x pairs of k. Where the CPU has AVX512-BF16 it multiplies bf16 rows by it with
`vdpbf16ps` (on AMD Zen 4 twice the rate of fp32 multiply-adds, with nothing to convert); on
every other variant, and for fp32 inputs, one shift or mask widens a bf16 pair and the kernel
multiplies in fp32, which without AMX beats oneDNN's bf16 GEMM (its bf16 matrix-vector product
reaches a third of memory bandwidth, and without AVX512-BF16 it converts every operand). Every
row count runs close to the arithmetic peak, and a single decode stream close to memory
bandwidth. It can fuse SwiGLU (`silu(gate) * up`) into the gate/up projection.

fp32 weights (fp32 models) are packed the same way, one k per panel row, and multiplied with
fp32 multiply-adds, each output summed over k in order (equal bits on every variant, tile and
thread count; a different summation order from oneDNN's, still fp32 throughout). Against torch's
fp32 `F.linear` the gain is at few rows: the panels keep every sum in a register for the whole
K loop, and a matrix-vector product (the LM head of one sequence) streams at memory bandwidth.

`pack(weight, bias)` returns a `PackedWeight`; `linear(x, packed)` computes `x @ weight.T + bias`.
The packed layout is the same for every kernel variant (`pagoda.kernels.build`). Where the
kernels cannot run (`pagoda.kernels.build.available()` is False) layers keep their weights
unpacked and use `F.linear`.

Benchmark: `python -m pagoda.kernels.cpu_gemm --bench`.
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagoda.kernels.build import available, ops, status
from pagoda.kernels.build import op as kernel_op
from pagoda.kernels.memory import huge_page_copy

PANEL = 16  # output columns per panel
_PLAIN, _SWIGLU = 0, 1


WEIGHT_DTYPES = (torch.bfloat16, torch.float32)


def applies_to(weight: torch.Tensor) -> bool:
    """Whether a layer with this weight should be packed: bf16 or fp32 on the CPU, kernel available."""
    return weight.dtype in WEIGHT_DTYPES and weight.device.type == "cpu" and weight.dim() == 2 and available()


@dataclass(frozen=True)
class PackedWeight:
    """A `[out_features, in_features]` bf16 or fp32 weight in the kernel's panel layout.

    bf16: `data` is `[panels, ceil(in_features / 2), 32]`: element `2 * i + e` of pair row `r` of
    panel `p` holds column `16 * p + i` at `k = 2 * r + e` (zero past the end). fp32: `data` is
    `[panels, in_features, 16]`, element `i` of row `k` of panel `p` holding column
    `16 * p + i` at k. With `swiglu`
    the source weight was `[gate; up]`, panels `2j` and `2j + 1` hold gate and up columns
    `16j..16j+15`, and `out_features` counts outputs of silu(gate) * up.
    """

    data: torch.Tensor
    out_features: int
    in_features: int
    swiglu: bool
    bias: torch.Tensor | None  # float32, [out_features] or [2 * out_features] with swiglu

    @property
    def epilogue(self) -> int:
        return _SWIGLU if self.swiglu else _PLAIN

    @property
    def dtype(self) -> torch.dtype:
        """The weight's dtype (bf16 or fp32); also the default output dtype of `linear`."""
        return self.data.dtype


def pack(weight: torch.Tensor, bias: torch.Tensor | None = None, swiglu: bool = False) -> PackedWeight:
    """Repack a bf16 or fp32 `[N, K]` weight (and bias) for `linear`; with `swiglu`,
    N = 2 * outputs."""
    if not available():
        raise RuntimeError(f"CPU GEMM kernel unavailable: {status().reason}")
    if weight.dim() != 2 or weight.dtype not in WEIGHT_DTYPES or not weight.is_cpu:
        raise ValueError(
            f"weight must be a 2-D bfloat16 or float32 CPU tensor, got {weight.dtype} {tuple(weight.shape)}"
        )
    n, k = weight.shape
    if swiglu and n % 2:
        raise ValueError(f"a gate/up weight needs an even number of rows, got {n}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias must have shape ({n},), got {tuple(bias.shape)}")
    data = huge_page_copy(ops().pack_weight(weight.detach(), swiglu))
    b = None if bias is None else bias.detach().float().contiguous()
    return PackedWeight(data, n // 2 if swiglu else n, k, swiglu, b)


def linear(x: torch.Tensor, packed: PackedWeight, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`x @ weight.T + bias` (or silu(gate) * up for a swiglu weight) for x of shape `[..., K]`,
    bf16 or fp32; the result has the weight's dtype, or `out_dtype` (bf16 or fp32). Sums in fp32,
    rounds once."""
    # Called ~100 times per decode step: checks stay cheap.
    if out_dtype is not None and out_dtype is not torch.bfloat16 and out_dtype is not torch.float32:
        raise ValueError(f"out_dtype must be bfloat16 or float32, got {out_dtype}")
    if x.shape[-1] != packed.in_features:
        raise ValueError(f"x has {x.shape[-1]} features, the weight expects {packed.in_features}")
    if x.requires_grad and torch.is_grad_enabled():
        raise ValueError("packed linear does not support autograd; call it under torch.no_grad()")
    out_fp32 = out_dtype is torch.float32 if out_dtype is not None else packed.data.dtype is torch.float32
    op = kernel_op("packed_linear")
    if x.dim() == 2:
        return op(x, packed.data, packed.out_features, packed.bias, packed.epilogue, out_fp32)
    flat = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
    out = op(flat, packed.data, packed.out_features, packed.bias, packed.epilogue, out_fp32)
    return out.reshape(*x.shape[:-1], packed.out_features)


def _columns(
    packed: PackedWeight, cols: torch.Tensor, panel_offset: int = 0, panel_step: int = 1
) -> torch.Tensor:
    """Columns `cols` (of panels `panel_offset + panel_step * j`) of the original weight, `[n, K]`."""
    panel = panel_offset + panel_step * (cols // PANEL)
    if packed.data.dtype is torch.float32:
        return packed.data[panel, :, cols % PANEL]  # [n, K]
    pairs = packed.data.view(packed.data.shape[0], packed.data.shape[1], PANEL, 2)
    rows = pairs[panel, :, cols % PANEL]  # [n, K2, 2]
    return rows.reshape(cols.shape[0], -1)[:, : packed.in_features]


def gather_rows(packed: PackedWeight, rows: torch.Tensor) -> torch.Tensor:
    """Rows `rows` of the original weight, `[*rows.shape, K]`: an embedding lookup straight from
    a (tied) LM head's packed weight. Plain layout only."""
    if packed.swiglu:
        raise ValueError("gather_rows needs a plain packed weight")
    return _columns(packed, rows.reshape(-1)).reshape(*rows.shape, packed.in_features)


def unpack(packed: PackedWeight) -> torch.Tensor:
    """The original `[N, K]` weight (for inspection and tests)."""
    cols = torch.arange(packed.out_features)
    if packed.swiglu:
        return torch.cat([_columns(packed, cols, 0, 2), _columns(packed, cols, 1, 2)])
    return _columns(packed, cols)


# ---------------------------------------------------------------------------------------------
# Benchmark

# (name, N, K, swiglu) of Qwen2.5-0.5B's linear layers (N counts gate and up for gate_up).
QWEN25_05B_SHAPES = (
    ("qkv", 1152, 896, False),
    ("o", 896, 896, False),
    ("gate_up", 9728, 896, True),
    ("down", 896, 4864, False),
    ("lm_head_32k", 32000, 896, False),
)
QWEN25_05B_LAYERS = 24


def median_time(
    fn: Callable[[], object], rounds: int, clock: Callable[[], float] = time.perf_counter
) -> float:
    """Median seconds of `fn` over `rounds` runs after two warm-ups, by `clock` (wall time; a
    1-thread comparison on a loaded machine passes `time.process_time`)."""
    for _ in range(2):
        fn()
    samples = []
    for _ in range(rounds):
        start = clock()
        fn()
        samples.append(clock() - start)
    return statistics.median(samples)


def bench(ms: list[int], rounds: int) -> None:
    """Kernel against torch's bf16 `F.linear` and fp32 `F.linear` on pre-converted weights."""
    if not available():
        raise SystemExit(f"kernel unavailable: {status().reason}")
    print(
        f"variant={status().variant} threads={torch.get_num_threads()} rounds={rounds} "
        "(median; GF/s counts 2*M*N*K)"
    )
    for m in ms:
        totals: dict[str, float] = {}
        for name, n, k, swiglu in QWEN25_05B_SHAPES:
            w = torch.randn(n, k).to(torch.bfloat16)
            x = torch.randn(m, k).to(torch.bfloat16)
            wf = w.float()
            packed = pack(w, swiglu=swiglu)
            fns: dict[str, Callable[[], object]] = {
                "bf16 F.linear": lambda x=x, w=w: F.linear(x, w),
                "fp32 F.linear": lambda x=x, wf=wf: F.linear(x.float(), wf),
                "kernel": lambda x=x, p=packed: linear(x, p),
            }
            times = {label: median_time(fn, rounds) for label, fn in fns.items()}
            gflop = 2 * m * n * k / 1e9
            cols = "  ".join(f"{label} {t * 1e3:8.3f}ms {gflop / t:4.0f}GF/s" for label, t in times.items())
            print(f"M={m:<5} {name:<12} {cols}", flush=True)
            count = 1 if name.startswith("lm_head") else QWEN25_05B_LAYERS
            for label, t in times.items():
                totals[label] = totals.get(label, 0.0) + count * t
        summary = "  ".join(f"{label} {t * 1e3:.1f}ms" for label, t in totals.items())
        print(
            f"M={m:<5} whole model (24 layers + 32k lm_head): {summary}  "
            f"kernel speedup x{totals['bf16 F.linear'] / totals['kernel']:.2f}"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m pagoda.kernels.cpu_gemm",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--bench", action="store_true", help="time the kernel against F.linear")
    parser.add_argument("--m", default="1,8,32,256,2048", help="comma-separated row counts")
    parser.add_argument("--rounds", type=int, default=9, help="timed rounds per shape (default 9)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args(argv)
    if not args.bench:
        parser.error("nothing to do: pass --bench")
    try:
        ms = [int(v) for v in args.m.split(",")]
    except ValueError:
        parser.error(f"--m must be comma-separated integers, got {args.m!r}")
    if any(m < 1 for m in ms):
        parser.error("--m values must be >= 1")
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    if args.threads is not None:
        if args.threads < 1:
            parser.error("--threads must be >= 1")
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO)
    bench(ms, rounds=args.rounds)


if __name__ == "__main__":
    main()
