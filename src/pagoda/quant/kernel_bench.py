"""Times pagoda's integer GEMM (`pagoda.kernels.cpu_quant`) against its bf16 kernel on the linear
layers of Qwen2.5-0.5B's shape, per GGML type and row count.

`python -m pagoda.quant.kernel_bench --types q8_0,q4_0 --m 1,32,2048` (`--help` for the rest).
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable

import torch

from pagoda.kernels import cpu_gemm, peak
from pagoda.kernels.build import available, ops, status
from pagoda.kernels.cpu_gemm import QWEN25_05B_LAYERS, QWEN25_05B_SHAPES, median_time
from pagoda.kernels.cpu_quant import GROUP_VALUES, SUPPORTED, PackedQuant, dot_kind, linear, pack
from pagoda.kernels.memory import huge_page_copy, huge_page_empty
from pagoda.quant.formats import GGMLType
from pagoda.quant.tensor import GGMLTensor

# (name, N, K) of Qwen2.5-0.5B's linear layers (gate_up counts gate and up), without the LM head.
SHAPES = tuple((name, n, k) for name, n, k, _ in QWEN25_05B_SHAPES if not name.startswith("lm_head"))
LAYERS = QWEN25_05B_LAYERS


def _distinct(t: torch.Tensor) -> torch.Tensor:
    """A copy of a packed tensor in fresh memory, on huge pages as packing puts it."""
    copy = huge_page_copy(t)
    return copy if copy is not t else t.clone()


def read_bandwidth(clock: Callable[[], float]) -> float:
    """GB/s of the kernels' read probe (`pagoda.kernels.bandwidth`) timed by `clock`, best of 5:
    the same clock as the kernels it is the roofline of."""
    buf = huge_page_empty(256 << 20).view(torch.float32).fill_(1.0)  # on huge pages, as the weights
    read = ops().memory_read
    read(buf)
    best = float("inf")
    for _ in range(5):
        start = clock()
        read(buf)
        best = min(best, clock() - start)
    return buf.numel() * 4 / best / 1e9


def bench(types: list[str], ms: list[int], rounds: int, per_shape: bool = False) -> None:
    """The linear layers of Qwen2.5-0.5B's shape on the integer kernel against the bf16 kernel.
    Up to 64 rows, 24 layers of distinct weights (a pass streams them from memory, as decode
    does); more rows are bound by arithmetic and time 2 layers. Times are per 24 layers.

    With one thread the times are process CPU time (others' load on the machine then costs
    little), else wall time. Up to 8 rows, the integer kernel's GB/s is also given as a share of
    the read bandwidth probe's (same threads and clock): its roofline; above 8 rows, where the
    arithmetic bounds both kernels, their GMAC/s are also given as a share of the compute peak
    probe's for their instruction (`pagoda.kernels.peak`). With `per_shape`, each
    layer shape is also timed alone (its 24 copies streamed), int and bf16 alternating."""
    if not available():
        raise SystemExit(f"kernels unavailable: {status().reason}")
    threads = torch.get_num_threads()
    clock = time.process_time if threads == 1 else time.perf_counter
    print(
        f"variant={status().variant} dot={dot_kind()} threads={threads} rounds={rounds} "
        f"(median {'process CPU time' if threads == 1 else 'wall time'})"
    )
    bandwidth = read_bandwidth(clock) if min(ms) <= 8 else None
    if bandwidth is not None:
        print(f"read bandwidth {bandwidth:.1f} GB/s (best of 5 reads of 256 MiB, same clock)")
    int_peak = bf16_peak = None
    if max(ms) > 8:
        bf16_kind = peak.bf16_kind()
        int_peak = peak.measure_gmac_s("int8_dot", clock=clock)
        bf16_peak = peak.measure_gmac_s(bf16_kind, clock=clock)
        print(
            f"compute peak {int_peak:.1f} GMAC/s int8_dot, {bf16_peak:.1f} GMAC/s {bf16_kind} "
            f"(the bf16 kernel's instruction; best of 5, same clock)"
        )
    gen = torch.Generator().manual_seed(0)
    dense = {name: torch.randn(n, k, generator=gen) * 0.02 for name, n, k in SHAPES}
    bf16 = {name: cpu_gemm.pack(w.bfloat16(), swiglu=name == "gate_up") for name, w in dense.items()}
    for type_name in types:
        qtype = GGMLType[type_name.upper()]
        # The K-quants need K a multiple of 256: at this width only `down` (as in llama.cpp's
        # Q4_K_M files, whose other layers are Q5_0 / Q8_0 here).
        group = GROUP_VALUES[int(qtype)]
        shapes = [(name, n, k) for name, n, k in SHAPES if k % group == 0]
        if len(shapes) < len(SHAPES):
            print(f"{type_name}: only {', '.join(name for name, _, _ in shapes)} (K a multiple of {group})")
        quant = {
            name: pack(int(qtype), GGMLTensor.quantize(dense[name], qtype).data, k, name == "gate_up")
            for name, _, k in shapes
        }
        for m in ms:
            layers = LAYERS if m <= 64 else 2
            # Copies per layer (same values, distinct memory) so that a pass reads every layer's bytes.
            layers_q = [
                {
                    n: PackedQuant(
                        p.qtype, _distinct(p.values), _distinct(p.scales), p.rows, p.cols, p.swiglu
                    )
                    for n, p in quant.items()
                }
                for _ in range(layers)
            ]
            layers_b = [
                {
                    n: cpu_gemm.PackedWeight(
                        _distinct(p.data), p.out_features, p.in_features, p.swiglu, p.bias
                    )
                    for n, p in bf16.items()
                }
                for _ in range(layers)
            ]
            xs = {name: torch.randn(m, k, generator=gen).bfloat16() for name, _, k in SHAPES}

            def run_q(layers_q=layers_q, xs=xs, names=tuple(quant)):
                for layer in layers_q:
                    for name in names:
                        linear(xs[name], [layer[name]])

            def run_b(layers_b=layers_b, xs=xs, names=tuple(quant)):
                for layer in layers_b:
                    for name in names:
                        cpu_gemm.linear(xs[name], layer[name])

            scale = LAYERS / layers
            tq = median_time(run_q, rounds, clock) * scale
            tb = median_time(run_b, rounds, clock) * scale
            gmac = m * sum(n * k for _, n, k in shapes) * LAYERS / 1e9
            qbytes = sum(p.nbytes for p in quant.values()) * LAYERS
            gb_s = qbytes / tq / 1e9
            roof = f" = {gb_s / bandwidth:4.0%} of the probe" if bandwidth and m <= 8 else ""
            int_roof = f" = {gmac / tq / int_peak:4.0%} of peak" if int_peak and m > 8 else ""
            bf16_roof = f" = {gmac / tb / bf16_peak:4.0%} of peak" if bf16_peak and m > 8 else ""
            print(
                f"{type_name:<5} M={m:<5} int {tq * 1e3:9.2f} ms ({gmac / tq:6.1f} GMAC/s{int_roof}, "
                f"{gb_s:5.1f} GB/s{roof})  "
                f"bf16 {tb * 1e3:9.2f} ms ({gmac / tb:6.1f} GMAC/s{bf16_roof})  int/bf16 speed x{tb / tq:.2f}",
                flush=True,
            )
            if per_shape:
                for name, n, k in shapes:
                    tq = median_time(lambda name=name: run_q(names=(name,)), rounds, clock) * scale
                    tb = median_time(lambda name=name: run_b(names=(name,)), rounds, clock) * scale
                    gmac = m * n * k * LAYERS / 1e9
                    gb_s = quant[name].nbytes * LAYERS / tq / 1e9
                    roof = f" = {gb_s / bandwidth:4.0%}" if bandwidth and m <= 8 else ""
                    print(
                        f"  {name:<8} {n}x{k:<5} int {tq * 1e3:8.2f} ms ({gmac / tq:6.1f} GMAC/s, "
                        f"{gb_s:5.1f} GB/s{roof})  "
                        f"bf16 {tb * 1e3:8.2f} ms ({gmac / tb:6.1f} GMAC/s)  x{tb / tq:.2f}",
                        flush=True,
                    )
            del layers_q, layers_b


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m pagoda.quant.kernel_bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--types", default="q8_0,q4_0,q5_0,q4_k,q6_k", help="comma-separated GGML types")
    parser.add_argument("--m", default="1,8,32,256,2048", help="comma-separated row counts")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per shape (default 5)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--per-shape", action="store_true", help="also time each layer shape alone")
    args = parser.parse_args(argv)
    try:
        ms = [int(v) for v in args.m.split(",")]
    except ValueError:
        parser.error(f"--m must be comma-separated integers, got {args.m!r}")
    if any(m < 1 for m in ms) or args.rounds < 1:
        parser.error("--m values and --rounds must be >= 1")
    types = [t.strip() for t in args.types.split(",") if t.strip()]
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
    bench(types, ms, args.rounds, args.per_shape)


if __name__ == "__main__":
    main()
