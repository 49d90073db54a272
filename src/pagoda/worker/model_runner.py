"""Turns a SchedulerOutput into a ForwardBatch, has the executor run it, and samples."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from pagoda.config import CacheConfig, ModelConfig
from pagoda.outputs import Logprob
from pagoda.request import Request
from pagoda.sample import DraftSpan, Sampler, SamplingMetadata, SamplingRow
from pagoda.sample.logprobs import next_token_logprobs, prompt_logprobs
from pagoda.step import GrammarMasks, SampledTokens, ScheduledRequest, SchedulerOutput
from pagoda.worker.batch import ForwardBatch
from pagoda.worker.executor import Executor

logger = logging.getLogger(__name__)

# Prompt-logprob rows go through the LM head in slices of at most this many bytes of float32
# logits (and at least 16 rows). A larger buffer is above glibc's largest mmap threshold (32 MiB),
# so every call maps fresh pages that the kernel zeroes on first touch: 656 rows of a 32,000-token
# vocabulary took 13,000-20,500 page faults and 0.15-0.34 ms a row, against 0.10-0.11 ms a row
# at 164-256 rows (AMD EPYC Zen 4, 2 threads).
_PROMPT_LOGITS_BYTES = 16 << 20


@dataclass
class ModelOutput:
    # request id -> what it sampled this step (the requests that reached their last known token):
    # one token, or with k drafts the verification result (accepted drafts, then its next token).
    sampled: dict[str, SampledTokens] = field(default_factory=dict)
    # request id -> one {token id: Logprob} per token in `sampled`, for the requests that asked.
    logprobs: dict[str, list[dict[int, Logprob]]] = field(default_factory=dict)
    # request id -> (first prompt position, its logprob entries in order) for the requests owed
    # prompt logprobs whose positions this step computed.
    prompt_logprobs: dict[str, tuple[int, list[dict[int, Logprob]]]] = field(default_factory=dict)
    # request id -> {token id: Logprob} of SamplingParams.next_token_ids, for the prompt-only
    # requests whose last prompt token this step computed.
    next_token_logprobs: dict[str, dict[int, Logprob]] = field(default_factory=dict)


class ModelRunner:
    """Rank 0's side of a step: turns the SchedulerOutput into a `ForwardBatch` (plain data), has
    the executor run it (on one rank or all of them) and samples from the logits it returns.
    Everything that needs the live requests (sampling rows, grammar masks, logprobs, drafts,
    seeded generators) stays here."""

    def __init__(self, model: ModelConfig, cache: CacheConfig, executor: Executor) -> None:
        self.device = model.device
        self.block_size = cache.block_size
        self.executor = executor
        self.weight_format: str = executor.weight_format
        self.vocab_size = executor.vocab_size
        self._prompt_logit_rows = max(16, _PROMPT_LOGITS_BYTES // (4 * self.vocab_size))
        self.sampler = Sampler(torch.Generator(device=model.device).manual_seed(model.seed))

    # ---- one step --------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(
        self,
        out: SchedulerOutput,
        masks: GrammarMasks | None = None,
        draft_probs: Mapping[str, torch.Tensor] | None = None,
    ) -> ModelOutput:
        """Run the step's forward pass and sample every row that needs it in one sampler call:
        one row per request that reached its last known token, plus one per draft token. The
        prompt positions owed prompt logprobs in this step's chunks are scored too.
        `draft_probs`: request id -> q of its drafts when a draft model drew them at random
        (verified by rejection sampling)."""
        # Fewest new tokens first (decodes, then verification steps and short chunks): the
        # attention backend batches the leading short ones in one call.
        batch = sorted(out.scheduled, key=lambda s: s.num_new_tokens)
        query_start = [0]
        for s in batch:
            query_start.append(query_start[-1] + s.num_new_tokens)
        sampling = [s.request for s in batch if s.samples]
        ends = dict(zip((s.request.request_id for s in batch), query_start[1:], strict=True))
        scored = self._prompt_logprob_rows(batch, ends)
        hidden_rows: list[int] = []
        rows: list[SamplingRow] = []
        mask_rows: list[int] = []
        spans: list[DraftSpan] = []
        for req in sampling:
            k = req.num_draft_tokens
            end = ends[req.request_id]
            drafts = req.token_ids[req.num_tokens - k :] if k else []
            if k:
                # q of a draft model's random drafts: verified by rejection sampling.
                q = draft_probs.get(req.request_id) if draft_probs else None
                spans.append(DraftSpan(len(rows), tuple(drafts), req.generator, q))
            hidden_rows.extend(range(end - k - 1, end))
            history = req.output_token_ids  # verified tokens only
            for i in range(k + 1):
                rows.append(
                    SamplingRow(
                        req.params,
                        req.prompt_token_ids,
                        history + drafts[:i],
                        req.stop_token_ids,
                        req.generator,
                    )
                )
            if masks is not None:
                first = masks.rows.get(req.request_id)
                mask_rows.extend([masks.free_row] * (k + 1) if first is None else range(first, first + k + 1))
        # Prompt-only requests scoring tokens after the prompt: their last row, once each.
        nexts = [
            s.request
            for s in batch
            if s.request.params.next_token_ids is not None and s.request.prompt_only and s.completes
        ]
        num_sampling = len(hidden_rows)
        hidden_rows.extend(ends[r.request_id] - 1 for r in nexts)
        num_head = len(hidden_rows)
        # Prompt-logprob rows share the sampling rows' LM-head call as far as one slice allows.
        prompt_rows = [row + i for _, _, row, count in scored for i in range(count)]
        hidden_rows.extend(prompt_rows[: max(0, self._prompt_logit_rows - num_head)])
        logits = self.executor.execute(self._prepare(batch, hidden_rows, out.block_copies))
        output = ModelOutput()
        if logits is None:
            return output
        if scored:
            output.prompt_logprobs = self._prompt_logprobs(scored, logits[num_head:])
        if nexts:
            asked = [req.params.next_token_ids for req in nexts]
            entries = next_token_logprobs(logits[num_sampling:num_head], asked)
            output.next_token_logprobs = {req.request_id: e for req, e in zip(nexts, entries, strict=True)}
        logits = logits[:num_sampling]
        if not sampling:
            return output
        bitmask = None
        if masks is not None:
            bitmask = masks.bitmask.index_select(0, torch.tensor(mask_rows, device=masks.bitmask.device))
        sampling_meta = SamplingMetadata.build(rows, self.vocab_size, self.device)
        result = self.sampler(logits, sampling_meta, bitmask, spans)
        tokens = result.sampled_token_ids.tolist()
        row_logprobs = result.logprobs.to_dicts() if result.logprobs is not None else {}
        accepted = iter(result.num_accepted)
        row = 0
        for req in sampling:
            k = req.num_draft_tokens
            n = next(accepted) if k else 0
            rid = req.request_id
            output.sampled[rid] = SampledTokens(tokens[row : row + n + 1], num_accepted_drafts=n)
            if row in row_logprobs:
                output.logprobs[rid] = [row_logprobs[r] for r in range(row, row + n + 1)]
            row += k + 1
        return output

    def _prompt_logprob_rows(
        self, batch: list[ScheduledRequest], ends: dict[str, int]
    ) -> list[tuple[Request, int, int, int]]:
        """For the requests owed prompt logprobs: (request, first prompt position this step
        scores, its flat row, number of positions). The row at position q predicts token q + 1."""
        spans = []
        for s in batch:
            req = s.request
            if req.prompt_logprobs_next is None:
                continue
            start = req.num_computed_tokens
            first = max(start, req.prompt_logprobs_next - 1)
            last = min(start + s.num_new_tokens, req.num_prompt_tokens - 1)
            if first < last:
                row = ends[req.request_id] - s.num_new_tokens + first - start
                spans.append((req, first + 1, row, last - first))
        return spans

    def _prompt_logprobs(
        self, spans: list[tuple[Request, int, int, int]], head: torch.Tensor
    ) -> dict[str, tuple[int, list[dict[int, Logprob]]]]:
        """The entries of `spans`: `head` holds the logits of their first rows (computed with the
        sampling rows in one LM-head call); the rest go through the LM head in slices."""
        rows = [row + i for _, _, row, count in spans for i in range(count)]
        targets = [t for req, pos, _, count in spans for t in req.token_ids[pos : pos + count]]
        ks = [req.params.prompt_logprobs for req, _, _, count in spans for _ in range(count)]
        entries: list[dict[int, Logprob]] = []
        off = 0
        while off < len(rows):
            if off < len(head):  # the first rows: `head` holds them all
                end, logits = len(head), head
            else:
                end = min(off + self._prompt_logit_rows, len(rows))
                logits = self.executor.compute_logits(torch.tensor(rows[off:end], dtype=torch.int64))
            ids = torch.tensor(targets[off:end], device=self.device)
            entries.extend(prompt_logprobs(logits, ids, tuple(ks[off:end])))
            off = end
        result = {}
        offset = 0
        for req, pos, _, count in spans:
            result[req.request_id] = (pos, entries[offset : offset + count])
            offset += count
        return result

    def _prepare(
        self,
        batch: list[ScheduledRequest],
        logits_rows: list[int],
        block_copies: list[tuple[int, int]],
    ) -> ForwardBatch:
        chunks = []
        for s in batch:
            start = s.request.num_computed_tokens
            chunks.append((s.request.token_ids[start : start + s.num_new_tokens], start, s.block_ids))
        return ForwardBatch.build(chunks, self.block_size, logits_rows, block_copies)
