"""Integer GEMM for GGML block weights (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) in the CPU
kernel variants.

`pack(qtype, rows, K)` repacks GGUF rows once into the kernels' tiled layout
(`csrc/quant_layout.h`: 16 output rows interleaved per 32-value block, the scales apart; the
file's bytes, Q4_K / Q5_K's 6-bit scales widened to bytes); `linear(x, [packed, ...])`
quantizes x to 8 bits per block of 32 (as llama.cpp does) and sums exact integer block dot
products, 16 output rows per instruction (`csrc/quant_gemm.cpp`: vpdpbusd with AVX512-VNNI /
AVX-VNNI, vpmaddubsw otherwise), then adds the bias or applies SwiGLU in the same call. The
result differs from the float product of the dequantized weight by the rounding of x to 8 bits
(at most half a step of each block's scale per value). `raw_rows` gives rows back as the file
stores them, for the reference dequantizer.

Where the kernels do not run (`pagoda.kernels.build.available()` is False) callers keep the
PyTorch reference (dequantize, then `F.linear`).

Benchmark: `python -m pagoda.kernels.cpu_quant --bench` (against the bf16 kernel, per row count).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from pagoda.kernels.build import available, ops, status

# GGML type ids the kernels take, and values per scale group (a row must hold whole groups).
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 6, 7, 8, 12, 13, 14
GROUP_VALUES = {Q8_0: 32, Q4_0: 32, Q4_1: 32, Q5_0: 32, Q5_1: 32, Q4_K: 256, Q5_K: 256, Q6_K: 256}
SUPPORTED = tuple(GROUP_VALUES)
TILE_ROWS = 16


@dataclass(frozen=True)
class PackedQuant:
    """A `[rows, cols]` weight of GGML type `qtype` in the tiled layout: `values` and `scales` are
    uint8 `[tiles, ...]`. With `swiglu` the weight is `[gate; up]` and its tiles come in (gate,
    up) pairs."""

    qtype: int
    values: torch.Tensor
    scales: torch.Tensor
    rows: int
    cols: int
    swiglu: bool = False

    @property
    def nbytes(self) -> int:
        return self.values.numel() + self.scales.numel()


def supports(qtype: int, cols: int) -> bool:
    """Whether a kernel multiplies `qtype` rows of `cols` values here."""
    group = GROUP_VALUES.get(int(qtype))
    return group is not None and cols % group == 0 and available()


def pack(qtype: int, raw: torch.Tensor, cols: int, swiglu: bool = False) -> PackedQuant:
    """GGUF rows `raw: uint8 [N, row_bytes]` of `qtype` → the kernels' layout (with `swiglu`,
    raw is `[gate; up]`)."""
    qtype = int(qtype)
    if qtype not in GROUP_VALUES:
        raise ValueError(f"no integer kernel for GGML type {qtype}")
    values, scales = ops().quant_pack(raw.contiguous(), qtype, cols, swiglu)
    return PackedQuant(qtype, values, scales, raw.shape[0], cols, swiglu)


def linear(
    x: torch.Tensor,
    segments: Sequence[PackedQuant],
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`x [M, K] @ W.T (+ bias)` where W stacks `segments` along its rows (or `silu(gate) * up`
    for one `swiglu` segment); `bias` is float32 over all rows. The result is in x's dtype
    (float32 or bfloat16), or float32 with `out_dtype=torch.float32`."""
    swiglu = segments[0].swiglu
    if swiglu and len(segments) > 1:
        raise ValueError("a SwiGLU weight is a single segment")
    return ops().quant_linear(
        x,
        [s.values for s in segments],
        [s.scales for s in segments],
        [s.qtype for s in segments],
        [s.rows for s in segments],
        bias,
        swiglu,
        out_dtype is torch.float32,
    )


def raw_rows(packed: PackedQuant, index: torch.Tensor) -> torch.Tensor:
    """Rows `index` (1-D, of the original weight) as GGUF stores them: uint8 `[len, row_bytes]`."""
    return ops().quant_unpack(
        packed.values, packed.scales, packed.qtype, packed.cols, packed.rows, packed.swiglu, index
    )


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`x: [M, K]` (float32 or bfloat16) → (int8 values, float32 block scales, int32 block sums):
    the 8-bit activations `linear` multiplies (tests compare against them)."""
    return ops().quant_act_q8(x.contiguous())


def dot_kind() -> str:
    """Which integer dot product the kernels use on this CPU (avx512_vnni, avx512_maddubs,
    avx_vnni or avx2_maddubs)."""
    return ops().quant_dot_kind()


def dot_kinds() -> list[str]:
    """Every integer dot product the kernel variant in use can run on this CPU, fastest first."""
    return list(ops().quant_dot_kinds())


@contextlib.contextmanager
def use_dot(name: str) -> Iterator[None]:
    """Run the kernels on dot product `name` inside the block (tests; not thread-safe)."""
    previous = dot_kind()
    ops().quant_use_dot(name)
    try:
        yield
    finally:
        ops().quant_use_dot(previous)


# ---------------------------------------------------------------------------------------------
# Benchmark

# (name, N, K) of Qwen2.5-0.5B's linear layers (gate_up counts gate and up).
SHAPES = (("qkv", 1152, 896), ("o", 896, 896), ("gate_up", 9728, 896), ("down", 896, 4864))
LAYERS = 24


def _median_time(fn: Callable[[], object], rounds: int) -> float:
    for _ in range(2):
        fn()
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def bench(types: list[str], ms: list[int], rounds: int) -> None:
    """The linear layers of Qwen2.5-0.5B's shape on the integer kernel against the bf16 kernel.
    Up to 64 rows, 24 layers of distinct weights (a pass streams them from memory, as decode
    does); more rows are bound by arithmetic and time 2 layers. Times are per 24 layers."""
    from pagoda.kernels import cpu_gemm
    from pagoda.quant.formats import GGMLType
    from pagoda.quant.tensor import GGMLTensor

    if not available():
        raise SystemExit(f"kernels unavailable: {status().reason}")
    print(
        f"variant={status().variant} dot={dot_kind()} threads={torch.get_num_threads()} rounds={rounds} (median)"
    )
    gen = torch.Generator().manual_seed(0)
    dense = {name: torch.randn(n, k, generator=gen) * 0.02 for name, n, k in SHAPES}
    bf16 = {name: cpu_gemm.pack(w.bfloat16(), swiglu=name == "gate_up") for name, w in dense.items()}
    for type_name in types:
        qtype = GGMLType[type_name.upper()]
        quant = {
            name: pack(int(qtype), GGMLTensor.quantize(w, qtype).data, w.shape[1], name == "gate_up")
            for name, w in dense.items()
        }
        for m in ms:
            layers = LAYERS if m <= 64 else 2
            # Copies per layer (same values, distinct memory) so that a pass reads every layer's bytes.
            layers_q = [
                {
                    n: PackedQuant(p.qtype, p.values.clone(), p.scales.clone(), p.rows, p.cols, p.swiglu)
                    for n, p in quant.items()
                }
                for _ in range(layers)
            ]
            layers_b = [
                {
                    n: cpu_gemm.PackedWeight(p.data.clone(), p.out_features, p.in_features, p.swiglu, p.bias)
                    for n, p in bf16.items()
                }
                for _ in range(layers)
            ]
            xs = {name: torch.randn(m, k, generator=gen).bfloat16() for name, _, k in SHAPES}

            def run_q(layers_q=layers_q, xs=xs):
                for layer in layers_q:
                    for name, p in layer.items():
                        linear(xs[name], [p])

            def run_b(layers_b=layers_b, xs=xs):
                for layer in layers_b:
                    for name, p in layer.items():
                        cpu_gemm.linear(xs[name], p)

            scale = LAYERS / layers
            tq, tb = _median_time(run_q, rounds) * scale, _median_time(run_b, rounds) * scale
            gmac = m * sum(n * k for _, n, k in SHAPES) * LAYERS / 1e9
            qbytes = sum(p.nbytes for p in quant.values()) * LAYERS
            print(
                f"{type_name:<5} M={m:<5} int {tq * 1e3:9.2f} ms ({gmac / tq:6.1f} GMAC/s, {qbytes / tq / 1e9:5.1f} GB/s)  "
                f"bf16 {tb * 1e3:9.2f} ms ({gmac / tb:6.1f} GMAC/s)  int/bf16 speed x{tb / tq:.2f}",
                flush=True,
            )
            del layers_q, layers_b


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m pagoda.kernels.cpu_quant",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--bench", action="store_true", help="time the integer kernels against the bf16 kernel"
    )
    parser.add_argument("--types", default="q8_0,q4_0,q5_0,q4_k,q6_k", help="comma-separated GGML types")
    parser.add_argument("--m", default="1,8,32,256,2048", help="comma-separated row counts")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per shape (default 5)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args(argv)
    if not args.bench:
        parser.error("nothing to do: pass --bench")
    try:
        ms = [int(v) for v in args.m.split(",")]
    except ValueError:
        parser.error(f"--m must be comma-separated integers, got {args.m!r}")
    if any(m < 1 for m in ms) or args.rounds < 1:
        parser.error("--m values and --rounds must be >= 1")
    types = [t.strip() for t in args.types.split(",") if t.strip()]
    from pagoda.quant.formats import GGMLType

    for t in types:
        if t.upper() not in GGMLType.__members__ or GGMLType[t.upper()] not in SUPPORTED:
            parser.error(
                f"--types: {t!r} is not one of {', '.join(GGMLType(q).name.lower() for q in SUPPORTED)}"
            )
    if args.threads is not None:
        if args.threads < 1:
            parser.error("--threads must be >= 1")
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO)
    bench(types, ms, args.rounds)


if __name__ == "__main__":
    main()
