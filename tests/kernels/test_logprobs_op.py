"""`token_logprobs` (csrc/logprobs.cpp) on every variant: logprobs against fp64 log_softmax,
ranks exactly as torch counts them, the same bits on every variant, and the torch fallback of
sample/logprobs.py agreeing with it."""

from __future__ import annotations

import pytest
import torch

from kernel_variants import on_every_variant, requires_variants
from pagoda.kernels import cpu_ops
from pagoda.sample import logprobs as sample_logprobs


def _reference(x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    lp = torch.log_softmax(x.double(), dim=-1).gather(1, ids)
    ranks = (x[:, None, :] > x.gather(1, ids)[:, :, None]).sum(dim=-1) + 1
    return lp, ranks


def _logits(rows: int, vocab: int, seed: int, scale: float = 4.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


# Vocabularies around the 16-lane vectors and the 64-entry unrolled pass; 1 to 9 ids a row (the
# kernel counts 4 ranks a pass).
@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 63, 64, 65, 500, 32000])
@pytest.mark.parametrize("width", [1, 4, 9])
def test_logprobs_and_ranks_against_fp64(variant: str, vocab: int, width: int) -> None:
    x = _logits(13, vocab, vocab * 10 + width)
    ids = torch.randint(0, vocab, (13, width), generator=torch.Generator().manual_seed(width))
    ids[0, 0] = int(x[0].argmax())  # rank 1
    ids[1, -1] = int(x[1].argmin())  # rank vocab (no ties in random logits)
    lp, ranks = cpu_ops.token_logprobs(x, ids)
    ref_lp, ref_ranks = _reference(x, ids)
    assert lp.dtype is torch.float32 and ranks.dtype is torch.int64 and lp.shape == ids.shape
    torch.testing.assert_close(lp.double(), ref_lp, atol=4e-6, rtol=0)
    assert torch.equal(ranks, ref_ranks)
    assert ranks[0, 0] == 1 and ranks[1, -1] == vocab


def test_ties_extremes_and_row_strides(variant: str) -> None:
    x = _logits(6, 300, 1, scale=1.0)
    x[0] = 2.5  # all tied: rank 1, logprob -log(V)
    x[1, :150] = 100.0  # half the row at a large logit: the rest's exp underflows
    x[2] *= 1e4  # wide range
    x[3, 7] = -3e4  # one very small logit
    wide = torch.zeros(6, 700)
    wide[:, 100:400] = x  # rows with a stride larger than their length
    ids = torch.tensor([[5], [3], [8], [7], [0], [299]])
    for logits in (x, wide[:, 100:400]):
        lp, ranks = cpu_ops.token_logprobs(logits, ids)
        ref_lp, ref_ranks = _reference(x, ids)
        torch.testing.assert_close(lp.double(), ref_lp, atol=4e-6, rtol=1e-6)
        assert torch.equal(ranks, ref_ranks)
    assert ranks[0, 0] == 1 and abs(lp[0, 0].item() + torch.log(torch.tensor(300.0)).item()) < 1e-6
    assert ranks[1, 0] == 1 and ranks[3, 0] == 300


def test_bf16_logits_and_bad_ids(variant: str) -> None:
    x = _logits(4, 70, 2).bfloat16()
    ids = torch.tensor([[1, 2], [3, 3], [0, 69], [68, 5]])
    lp, ranks = cpu_ops.token_logprobs(x, ids)
    ref_lp, ref_ranks = _reference(x.float(), ids)
    torch.testing.assert_close(lp.double(), ref_lp, atol=4e-6, rtol=0)
    assert torch.equal(ranks, ref_ranks)
    with pytest.raises(RuntimeError, match="not in"):
        cpu_ops.token_logprobs(x, torch.tensor([[1, 2], [3, 70], [0, 1], [1, 1]]))
    with pytest.raises(RuntimeError, match="one row per"):
        cpu_ops.token_logprobs(x, ids[:3])


@requires_variants
def test_same_bits_on_every_variant() -> None:
    x = _logits(9, 1001, 3)
    ids = torch.randint(0, 1001, (9, 5), generator=torch.Generator().manual_seed(3))
    results = on_every_variant(lambda: cpu_ops.token_logprobs(x, ids))
    (first, *rest) = results.values()
    for other in rest:
        assert torch.equal(first[0], other[0]) and torch.equal(first[1], other[1])


def test_fallback_agrees_with_the_kernel(variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """sample/logprobs.py's two paths (the kernel, and torch where no kernels run) give the same
    ranks and logprobs within fp32 rounding, for prompt targets and next-token ids."""
    x = _logits(40, 3000, 4)
    targets = torch.randint(0, 3000, (40,), generator=torch.Generator().manual_seed(4))
    asked = [[1, 2, 3], [7], [9, 9, 10, 11, 12, 13]] * 13 + [[5]]
    native = (
        sample_logprobs.prompt_logprobs(x, targets, (0,) * 40),
        sample_logprobs.next_token_logprobs(x, asked),
    )
    monkeypatch.setattr(cpu_ops, "available", lambda: False)
    assert not cpu_ops.logprobs_applies(x)
    torch_path = (
        sample_logprobs.prompt_logprobs(x, targets, (0,) * 40),
        sample_logprobs.next_token_logprobs(x, asked),
    )
    for a_rows, b_rows in zip(native, torch_path, strict=True):
        assert len(a_rows) == len(b_rows)
        for a, b in zip(a_rows, b_rows, strict=True):
            assert a.keys() == b.keys()
            for t in a:
                assert a[t].rank == b[t].rank
                assert abs(a[t].logprob - b[t].logprob) < 1e-5
