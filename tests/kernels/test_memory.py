"""Packed weights copied onto huge-page slabs (pagoda.kernels.memory): equal, contiguous, apart,
aligned; small tensors stay where they are; the packers' results live on the slabs."""

from __future__ import annotations

import itertools

import pytest
import torch

from pagoda.kernels import build, cpu_gemm, cpu_quant, memory
from pagoda.quant.formats import GGMLType
from pagoda.quant.tensor import GGMLTensor


def _span(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8, torch.int32])
def test_copy_is_equal_contiguous_and_apart(dtype):
    gen = torch.Generator().manual_seed(0)
    sources = [
        (torch.randn(700, 513, generator=gen) * 100).to(dtype),  # an odd byte count
        (torch.randn(3, 300, 401, generator=gen) * 100).to(dtype),
        (torch.randn(1, memory.MIN_BYTES, generator=gen) * 100).to(dtype),
    ]
    copies = [memory.huge_page_copy(t) for t in sources]
    for src, copy in zip(sources, copies, strict=True):
        assert copy is not src and copy.is_contiguous()
        assert copy.dtype == src.dtype and copy.shape == src.shape and torch.equal(copy, src)
        assert copy.data_ptr() % 4096 == 0  # pieces start on page boundaries
    spans = sorted(_span(c) for c in copies + sources)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))  # no two share a byte
    copies[0].fill_(0)  # writing a copy leaves the others and the sources alone
    assert torch.equal(copies[1], sources[1]) and torch.equal(copies[2], sources[2])
    assert sources[0].any() and not copies[0].any()


def test_small_tensors_stay_and_large_ones_start_slabs_on_huge_pages():
    small = torch.ones(memory.MIN_BYTES // 4 - 1)
    assert memory.huge_page_copy(small) is small
    big = torch.arange(memory.SLAB_BYTES // 4 + 1, dtype=torch.int32)  # does not fit a slab's rest
    copy = memory.huge_page_copy(big)
    assert torch.equal(copy, big) and copy.data_ptr() % memory.HUGE_PAGE == 0
    del copy  # the slab goes with its last piece
    assert torch.equal(memory.huge_page_copy(torch.zeros(1 << 20)), torch.zeros(1 << 20))


def test_huge_page_empty_is_its_own_aligned_buffer():
    buf = memory.huge_page_empty(3 << 20)
    assert buf.dtype == torch.uint8 and buf.numel() == 3 << 20 and buf.data_ptr() % memory.HUGE_PAGE == 0
    other = memory.huge_page_empty(5)
    assert _span(other)[0] >= _span(buf)[1] or _span(other)[1] <= _span(buf)[0]
    buf.fill_(7)
    assert int(buf.sum()) == 7 * (3 << 20)
    with pytest.raises(ValueError, match="nbytes"):
        memory.huge_page_empty(0)


@pytest.mark.skipif(not build.available(), reason="the CPU kernels need x86-64 with AVX2")
def test_packers_put_large_weights_on_slabs():
    """A quantized and a bf16 packed weight over MIN_BYTES are slab pieces (page-aligned views of
    a larger buffer), and still multiply as before."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(1024, 1024, generator=gen)
    x = torch.randn(5, 1024, generator=gen)
    q = cpu_quant.pack(int(GGMLType.Q8_0), GGMLTensor.quantize(w, GGMLType.Q8_0).data, 1024)
    b = cpu_gemm.pack(w.bfloat16())
    for t in (q.values, b.data):
        assert t.data_ptr() % 4096 == 0 and t.untyped_storage().nbytes() > t.numel() * t.element_size()
    plain = cpu_quant.PackedQuant(q.qtype, q.values.clone(), q.scales.clone(), q.rows, q.cols)
    assert torch.equal(cpu_quant.linear(x, [q]), cpu_quant.linear(x, [plain]))
    assert torch.equal(
        cpu_gemm.linear(x.bfloat16(), b),
        cpu_gemm.linear(x.bfloat16(), cpu_gemm.PackedWeight(b.data.clone(), 1024, 1024, False, None)),
    )
