"""Logprobs of the raw model distribution for the rows that asked for them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagoda.kernels import cpu_ops
from pagoda.outputs import Logprob


@dataclass(frozen=True, eq=False)
class LogprobsTensors:
    """Column 0 is the sampled token; columns 1..K the top-K tokens by descending logprob, where
    K is the largest N asked in the batch (a row that asked for N < K uses columns 1..N only)."""

    row_indices: torch.Tensor  # [L] int64: the batch rows these belong to, ascending
    token_ids: torch.Tensor  # [L, 1 + K] int64
    logprobs: torch.Tensor  # [L, 1 + K] float32
    sampled_token_ranks: torch.Tensor  # [L] int64: 1 + the number of tokens with a larger logprob
    num_logprobs: tuple[int, ...]  # N for each row

    def to_dicts(self) -> dict[int, dict[int, Logprob]]:
        """For each batch row: the sampled token (with its rank) then its top-N tokens (ranks 1..N)."""
        rows = self.row_indices.tolist()
        token_ids = self.token_ids.tolist()
        logprobs = self.logprobs.tolist()
        ranks = self.sampled_token_ranks.tolist()
        result: dict[int, dict[int, Logprob]] = {}
        for i, (row, n) in enumerate(zip(rows, self.num_logprobs, strict=True)):
            entry = {token_ids[i][0]: Logprob(logprobs[i][0], rank=ranks[i])}
            for j in range(1, n + 1):
                entry.setdefault(token_ids[i][j], Logprob(logprobs[i][j], rank=j))
            result[row] = entry
        return result


def gather_logprobs(
    raw_logprobs: torch.Tensor,
    sampled: torch.Tensor,
    row_indices: torch.Tensor,
    num_logprobs: tuple[int, ...],
) -> LogprobsTensors:
    """raw_logprobs: [L, V] log_softmax of the unprocessed logits; sampled: [L] the chosen tokens."""
    sampled = sampled.unsqueeze(1)
    sampled_logprobs = raw_logprobs.gather(1, sampled)
    ranks = (raw_logprobs > sampled_logprobs).sum(dim=-1) + 1
    top = raw_logprobs.topk(max(num_logprobs, default=0), dim=-1)
    return LogprobsTensors(
        row_indices=row_indices,
        token_ids=torch.cat([sampled, top.indices], dim=1),
        logprobs=torch.cat([sampled_logprobs, top.values], dim=1),
        sampled_token_ranks=ranks,
        num_logprobs=num_logprobs,
    )


# Rows per slice of the target-only prompt-logprob path (its float32 copy stays in cache).
_TARGET_ONLY_ROWS = 32


def prompt_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, num_logprobs: tuple[int, ...]
) -> list[dict[int, Logprob]]:
    """logits: [L, V] at the positions before L prompt tokens; targets: [L] those tokens. For
    each row, the target's logprob (with its rank) then its top-k (vLLM's prompt_logprobs)."""
    if not any(num_logprobs):
        return _target_logprobs(logits, targets)
    raw = torch.log_softmax(logits.float(), dim=-1)
    rows = torch.arange(len(targets), device=logits.device)
    entries = gather_logprobs(raw, targets, rows, num_logprobs).to_dicts()
    return [entries[i] for i in range(len(targets))]


def _target_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> list[dict[int, Logprob]]:
    """The targets' logprobs and ranks alone (prompt_logprobs 0, as select asks): the logit less
    the row's log-sum-exp, natively where the kernels run (two passes over each row), else a few
    rows at a time, instead of a whole [L, V] log_softmax."""
    if cpu_ops.logprobs_applies(logits):
        lp, rank = cpu_ops.token_logprobs(logits, targets[:, None])
        values, ranks = lp[:, 0].tolist(), rank[:, 0].tolist()
    else:
        values, ranks = [], []
        for start in range(0, len(targets), _TARGET_ONLY_ROWS):
            x = logits[start : start + _TARGET_ONLY_ROWS].float()
            target = x.gather(1, targets[start : start + _TARGET_ONLY_ROWS, None])
            values += (target - torch.logsumexp(x, dim=-1, keepdim=True))[:, 0].tolist()
            ranks += ((x > target).sum(dim=-1) + 1).tolist()
    return [{t: Logprob(v, rank=r)} for t, v, r in zip(targets.tolist(), values, ranks, strict=True)]


# Elements of the rank comparison per slice of next_token_logprobs (rows x ids x vocabulary).
_RANK_ELEMENTS = 1 << 23


def next_token_logprobs(logits: torch.Tensor, token_ids: Sequence[Sequence[int]]) -> list[dict[int, Logprob]]:
    """logits: [N, V], one row per request; token_ids: the ids (distinct or not, at least one)
    each row asks for. For each row, the logprob and rank of each of its ids there, by the same
    arithmetic as a prompt token's (the logit less the row's log-sum-exp). The rows' ids are
    padded to the widest row's; without the kernels, rows go in slices, so that the [rows, ids,
    V] comparison stays bounded."""
    width = max(map(len, token_ids), default=1)
    padded = [list(ids) + [ids[0]] * (width - len(ids)) for ids in token_ids]
    if cpu_ops.logprobs_applies(logits):
        values, ranks = cpu_ops.token_logprobs(logits, torch.tensor(padded, dtype=torch.int64))
        return _entries(token_ids, values.tolist(), ranks.tolist())
    per_slice = max(1, _RANK_ELEMENTS // (width * logits.shape[-1]))
    result: list[dict[int, Logprob]] = []
    for start in range(0, len(token_ids), per_slice):
        asked = padded[start : start + per_slice]
        x = logits[start : start + len(asked)].float()
        values = x.gather(1, torch.tensor(asked, device=x.device))
        lse = torch.logsumexp(x, dim=-1, keepdim=True)
        ranks = ((x[:, None, :] > values[:, :, None]).sum(dim=-1) + 1).tolist()
        result += _entries(token_ids[start : start + len(asked)], (values - lse).tolist(), ranks)
    return result


def _entries(
    token_ids: Sequence[Sequence[int]], values: list[list[float]], ranks: list[list[int]]
) -> list[dict[int, Logprob]]:
    """Each row's {id: Logprob} over its own ids (the padding dropped)."""
    return [
        {t: Logprob(v, rank=r) for t, v, r in zip(ids, row_values, row_ranks, strict=False)}
        for ids, row_values, row_ranks in zip(token_ids, values, ranks, strict=True)
    ]
