"""`prompt_logprobs` on raw logit rows: the target-only path (0 top tokens asked, as select asks)
against log_softmax."""

from __future__ import annotations

import torch

from pagoda.sample.logprobs import prompt_logprobs


def test_target_only_rows_equal_log_softmax() -> None:
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(70, 500, generator=g) * 4).to(torch.bfloat16)  # more rows than one slice
    targets = torch.randint(0, 500, (70,), generator=g)
    logits[3, :] = 1.0  # ties everywhere: rank 1
    ref = torch.log_softmax(logits.float(), dim=-1)
    entries = prompt_logprobs(logits, targets, (0,) * 70)
    for i, (entry, t) in enumerate(zip(entries, targets.tolist(), strict=True)):
        assert list(entry) == [t]
        assert abs(entry[t].logprob - ref[i, t].item()) < 1e-5
        assert entry[t].rank == int((ref[i] > ref[i, t]).sum()) + 1
    assert entries[3][targets[3].item()].rank == 1
    # With top tokens asked for any row, every row takes the log_softmax path (same targets).
    mixed = prompt_logprobs(logits, targets, (0,) * 69 + (2,))
    for i, t in enumerate(targets.tolist()):
        assert abs(mixed[i][t].logprob - entries[i][t].logprob) < 1e-5
        assert mixed[i][t].rank == entries[i][t].rank
    assert len(mixed[69]) >= 2
