"""Top-k, top-p and min-p filters, in place on probabilities (softmax of temperature-scaled logits).

Each filter becomes a per-row probability threshold: tokens below it are set to 0, and the rows
are left unnormalized (the draw does not need it). Thresholds make ties well defined (a token tied
with the last kept one is kept too) and need no scatter back from sorted order. Top-k and top-p
read their candidates from one `topk`; only rows whose top-p cut-off falls outside the candidates
pay for a full sort.
"""

from __future__ import annotations

import torch


def apply_top_k_top_p(
    probs: torch.Tensor,
    top_k: torch.Tensor | None,
    max_top_k: int,
    top_p: torch.Tensor | None,
    num_candidates: int,
    top_p_within_top_k: bool = False,
) -> None:
    """top_k: [B] int64 with vocab_size where disabled (max_top_k: largest enabled value);
    top_p: [B] float32 with 1.0 where disabled. Top-p acts on the distribution left by top-k.
    top_p_within_top_k: every row with top-p has top-k, so the top max_top_k are candidates enough."""
    vocab_size = probs.shape[-1]
    extra = num_candidates if top_p is not None and not top_p_within_top_k else 0
    width = min(vocab_size, max(max_top_k, extra))
    candidates = probs.topk(width, dim=-1).values  # descending
    if top_k is not None:
        kth = candidates.gather(1, (top_k.clamp(max=width) - 1).unsqueeze(1))
        kth.masked_fill_((top_k >= vocab_size).unsqueeze(1), 0.0)
        probs.masked_fill_(probs < kth, 0.0)
        candidates.masked_fill_(candidates < kth, 0.0)
    if top_p is None:
        return
    total = probs.sum(dim=-1, keepdim=True)
    threshold, covered = _top_p_threshold(candidates, total, top_p, complete=width == vocab_size)
    if not bool(covered.all()):
        rows = (~covered).nonzero().squeeze(1)
        full = probs.index_select(0, rows).sort(dim=-1, descending=True).values
        row_threshold, _ = _top_p_threshold(full, total[rows], top_p[rows], complete=True)
        threshold.index_copy_(0, rows, row_threshold)
    probs.masked_fill_(probs < threshold, 0.0)


def _top_p_threshold(
    sorted_probs: torch.Tensor, total: torch.Tensor, top_p: torch.Tensor, *, complete: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Probability of the last token of the smallest top set whose share of total reaches top_p
    ([B, 1]; 0 where top_p is 1), and whether that token lies within sorted_probs ([B] bool)."""
    cumulative = sorted_probs.cumsum(dim=-1)
    mass = top_p.unsqueeze(1) * total
    # Token i is kept while the mass before it is below p: the top token always is.
    keep = 1 + (cumulative[:, :-1] < mass).sum(dim=-1, keepdim=True)
    threshold = sorted_probs.gather(1, keep - 1)
    threshold.masked_fill_(top_p.unsqueeze(1) >= 1.0, 0.0)
    if complete:
        covered = torch.ones_like(top_p, dtype=torch.bool)
    else:
        covered = (cumulative[:, -1:] >= mass).squeeze(1) | (top_p >= 1.0)
    return threshold, covered


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> None:
    """Drop tokens with probability below min_p times the top token's (min_p = 0 keeps all)."""
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    probs.masked_fill_(probs < threshold, 0.0)
