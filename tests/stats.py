"""Pearson's chi-square goodness-of-fit test, for the tests that check sampled tokens against an
exact distribution (rejection sampling, alone and end to end with a draft model)."""

from __future__ import annotations

import torch


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of observed counts against cell probabilities (both flattened) and its
    degrees of freedom. Cells expected to hold fewer than 5 are pooled into one; cells of
    probability 0 must be empty."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    assert counts[probs == 0].sum() == 0, "a token of probability 0 was sampled"
    counts, probs = counts[probs > 0], probs[probs > 0]
    expected = probs / probs.sum() * counts.sum()
    small = expected < 5
    if small.any():
        counts = torch.cat([counts[~small], counts[small].sum().view(1)])
        expected = torch.cat([expected[~small], expected[small].sum().view(1)])
    return float(((counts - expected) ** 2 / expected).sum()), counts.numel() - 1


def pvalue(stat: float, df: int) -> float:
    """The probability of a chi-square statistic of `df` degrees of freedom at least `stat`."""
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """The p-value of Pearson's test of `counts` against `probs` (see chi_square)."""
    return pvalue(*chi_square(counts, probs))
