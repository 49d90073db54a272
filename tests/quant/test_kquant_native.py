"""The C++ K-quant quantizer (`kernels/csrc/quant_kquant.cpp`) against the PyTorch one it ports:
the same bytes for Q4_K, Q5_K and Q6_K, on every kernel variant, for ordinary weights and the
edge cases of the reference search (all-zero, flat, tiny, one-signed, integer-valued, huge)."""

from __future__ import annotations

import pytest
import torch
from tests.kernel_variants import requires_variants, variant_params

from pagoda.kernels import build, cpu_quant
from pagoda.quant.formats import GGMLType
from pagoda.quant.quantize import quantize

K_TYPES = (GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K)


def _weights() -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(48, 1024, generator=gen) * 0.02
    w[0] = 0.0  # all-zero super-blocks
    w[1, :32] = 1.5  # a flat sub-block
    w[1, 256:272] = -0.25  # a flat Q6_K sub-block
    w[2] = torch.randn(1024, generator=gen) * 1e-20  # scales below fp16's range
    w[3, ::7] = 0.0
    w[4] = w[4].abs()  # every value positive: the min is 0
    w[5] = -w[5].abs()
    w[6] = torch.randn(1024, generator=gen) * 100.0
    w[7] = torch.randint(-3, 4, (1024,), generator=gen).float()  # ties in the rounding
    w[8, :256] = torch.linspace(-1, 1, 256)
    w[9, 300] = 5.0  # one outlier in a super-block
    return w


@requires_variants
@pytest.mark.parametrize("variant", variant_params())
@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
def test_native_k_quants_equal_the_pytorch_quantizer(variant, qtype):
    w = _weights()
    reference = quantize(w, qtype, kernels=False)
    with build.use_variant(variant):
        assert cpu_quant.quantizes(qtype)
        native = quantize(w, qtype)
    assert native.dtype == torch.uint8 and native.shape == reference.shape
    assert torch.equal(native, reference), f"{(native != reference).any(-1).sum().item()} rows differ"


@requires_variants
def test_native_quantizer_rejects_bad_input():
    with pytest.raises(RuntimeError, match="Q4_K, Q5_K or Q6_K"):
        cpu_quant.quantize_k(torch.zeros(1, 256), int(GGMLType.Q8_0))
    with pytest.raises(RuntimeError, match=r"\[n, 256\]"):
        cpu_quant.quantize_k(torch.zeros(2, 128), int(GGMLType.Q4_K))
    with pytest.raises(RuntimeError, match=r"\[n, 256\]"):
        cpu_quant.quantize_k(torch.zeros(1, 256, dtype=torch.float64), int(GGMLType.Q6_K))
