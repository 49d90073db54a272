"""Memory read bandwidth, measured: the ceiling of single-stream decode, which reads every weight
once per token (the roofline of `pagoda bench offline`, and `pagoda info --bandwidth`).

The probe streams a buffer far larger than any cache with every torch thread, through the
kernels' vector loads (`csrc/bandwidth.cpp`) where they run, else through `torch.amax`; it
reports the best of a few passes (the rate the hardware allows) and their median. The buffer
lies on huge pages (`memory.huge_page_empty`) as the packed weights do: on 4 KiB pages every
4 KiB read waits on a TLB miss, and the probe read less than the kernels stream (AMD EPYC Zen
4, best of 5 reads of 512 MiB under load: 1 thread 12.8-15.1 vs 18.1-19.6 GB/s on huge pages,
2 threads 15.9-17.4 vs 22.8-26.4; the Q4_0 one-row GEMV streamed up to 25-30 GB/s at 1 thread).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from pagoda.kernels import build
from pagoda.kernels.memory import huge_page_empty

DEFAULT_BUFFER_MB = 512
DEFAULT_REPEATS = 5


@dataclass(frozen=True)
class Bandwidth:
    best_gb_s: float  # 1 GB = 1e9 bytes
    median_gb_s: float
    buffer_mb: int
    repeats: int
    threads: int
    method: str

    def describe(self) -> str:
        return (
            f"{self.best_gb_s:.1f} GB/s (best of {self.repeats} reads of {self.buffer_mb} MiB with "
            f"{self.threads} threads, median {self.median_gb_s:.1f}; {self.method})"
        )

    def to_dict(self) -> dict:
        return asdict(self)


def measure_read_bandwidth(buffer_mb: int = DEFAULT_BUFFER_MB, repeats: int = DEFAULT_REPEATS) -> Bandwidth:
    """Read a `buffer_mb` MiB buffer `repeats` times (after one untimed pass)."""
    if not isinstance(buffer_mb, int) or buffer_mb < 1:
        raise ValueError(f"buffer_mb must be a positive integer, got {buffer_mb!r}")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive integer, got {repeats!r}")
    nbytes = buffer_mb << 20
    buf = huge_page_empty(nbytes).view(torch.float32).fill_(1.0)  # written once: every page is mapped
    if build.available():
        op = build.ops().memory_read.default
        method = "the kernels' vector loads, huge pages"

        def read() -> None:
            op(buf)
    else:
        method = "torch.amax"

        def read() -> None:
            buf.amax()

    read()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        read()
        samples.append(time.perf_counter() - start)
    rates = [nbytes / s / 1e9 for s in samples]
    return Bandwidth(
        round(max(rates), 2),
        round(statistics.median(rates), 2),
        buffer_mb,
        repeats,
        torch.get_num_threads(),
        method,
    )
