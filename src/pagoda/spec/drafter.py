"""The engine core's one place that writes draft tokens: after a step's tokens are verified, each
proposer in turn may extend a request's drafts for the next step.

Proposers, in order (each continues the drafts of those before it):
- grammar-forced tokens (structured output's jump-forward): what the grammar allows only;
- the request's predicted output (`SamplingParams.prediction`, spec/prediction.py), filtered by
  its grammar; it needs no `speculative_config`;
- n-gram prompt lookup (`speculative_config` method "ngram"), filtered by the request's grammar;
  or the draft model (method "draft_model", spec/draft_model.py): `propose` queues the request,
  and `flush` runs the draft model once for every queued request of the step, batched.

Exactness does not depend on a proposer: the sampler keeps a draft only where sampling the target
model would have chosen it anyway (greedy, or the same seeded draw), so outputs are those without
speculation. A proposer only decides how many forward passes that takes.

Per-request state: the drafter keeps one `DraftRecord` per live request (the prediction's
alignment, the n-gram index, how many drafts its grammar forced, q of the draft model's drafts),
made when the core adds the request and freed when it finishes or is aborted (`release`); the
core's invariant check asks that the records are exactly the scheduler's requests. The draft
model's KV records are the `DraftModelProposer`'s (per step: only those it drafted for keep one).

The load gate: speculative drafts only while at most `SpeculativeConfig.max_running` requests
run (prediction drafts under `EngineConfig.prediction_max_running`, the same unless speculation
is not configured; grammar-forced ones under `StructuredOutputConfig.jump_forward_max_running`). A request in
a large decode batch gains little from saving a step, and on a compute-bound CPU every rejected
draft token costs a token of work (see pagoda.engine.resolve).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagoda.config import SpeculativeConfig, StructuredOutputConfig
from pagoda.request import Request
from pagoda.spec.draft_model import DraftItem, DraftModelProposer
from pagoda.spec.ngram import NgramIndex
from pagoda.spec.prediction import MATCH_MAX, PREDICTION_NUM_DRAFTS, Prediction
from pagoda.step import SampledTokens, ScheduledRequest

if TYPE_CHECKING:
    from pagoda.structured import GrammarManager


@dataclass
class SpecDecodeStats:
    """Totals since the engine started, counted when drafts are verified (vLLM's counters)."""

    num_drafts: int = 0  # verified draft spans (a request's drafts in one step)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_jump_forward_tokens: int = 0  # grammar-forced drafts proposed
    num_jump_forward_accepted: int = 0  # grammar-forced drafts that sampling confirmed


@dataclass(eq=False)
class DraftRecord:
    """One request's drafting state, the drafter's alone."""

    prediction: Prediction | None = None  # SamplingParams.prediction: its alignment and counts
    ngram: NgramIndex | None = None  # n-gram lookup over the verified tokens, made on first use
    num_forced: int = 0  # how many of the drafts (the first ones) the grammar forced, until verified
    # float32 [num drafts, vocab]: q of each draft when the draft model drew them at random (the
    # rejection sampler's input; one-hot rows for deterministic drafts before the model's), until
    # they are verified; else None.
    probs: torch.Tensor | None = None


class Drafter:
    def __init__(
        self,
        spec: SpeculativeConfig | None,
        structured: StructuredOutputConfig,
        max_model_len: int,
        prediction_max_running: int | None = None,
        draft_model: DraftModelProposer | None = None,
    ):
        self.spec = spec
        self.draft_model = draft_model
        self._queue: list[DraftItem] = []  # this step's requests for the draft model
        self._drafted: set[str] = set()
        self.structured = structured
        self.max_model_len = max_model_len
        self.prediction_limit = float("inf") if prediction_max_running is None else prediction_max_running
        self.prediction_num_drafts = spec.num_speculative_tokens if spec else PREDICTION_NUM_DRAFTS
        self.stats = SpecDecodeStats()
        self._records: dict[str, DraftRecord] = {}  # request id -> its record, while it lives

    # ---- records ---------------------------------------------------------------------------------
    def add(self, request_id: str, prediction_token_ids: Sequence[int] | None = None) -> None:
        """A new request (the core's add_request): its record, with its predicted output if any."""
        prediction = Prediction(prediction_token_ids) if prediction_token_ids is not None else None
        self._records[request_id] = DraftRecord(prediction)

    def release(self, request_ids: Iterable[str]) -> None:
        """Requests that finished or were aborted: their record goes, and their draft KV."""
        ids = list(request_ids)
        for rid in ids:
            self._records.pop(rid, None)
        if self.draft_model is not None:
            self.draft_model.release(ids)

    @property
    def num_records(self) -> int:
        return len(self._records)

    def prediction_tokens(self, request_id: str) -> tuple[int, int] | None:
        """(accepted, rejected) prediction drafts of a request with a predicted output, else None."""
        p = self._records[request_id].prediction
        return None if p is None else (p.num_accepted, p.num_rejected)

    def draft_probs(self, scheduled: Iterable[ScheduledRequest]) -> dict[str, torch.Tensor]:
        """q of the draft-model drafts that these scheduled requests verify (the runner's input)."""
        if self.draft_model is None:
            return {}
        probs = {}
        for s in scheduled:
            rid = s.request.request_id
            q = self._records[rid].probs
            if q is not None and s.request.num_draft_tokens:
                probs[rid] = q
        return probs

    # ---- one step --------------------------------------------------------------------------------
    def record_verified(self, req: Request, num_accepted: int) -> None:
        """`req`'s drafts (still in its token ids) were verified; `num_accepted` of them kept."""
        num_drafts = req.num_draft_tokens
        record = self._records[req.request_id]
        forced, record.num_forced, record.probs = record.num_forced, 0, None
        if num_drafts:
            self.stats.num_drafts += 1
            self.stats.num_draft_tokens += num_drafts
            self.stats.num_accepted_tokens += num_accepted
            self.stats.num_jump_forward_accepted += min(num_accepted, forced)
        if record.prediction is not None:
            record.prediction.record_verified(num_drafts, num_accepted)

    def propose(
        self, req: Request, tokens: list[int], num_running: int, grammars: GrammarManager | None
    ) -> list[int]:
        """Draft tokens to follow `tokens` (this step's verified tokens of `req`, not yet appended).
        A constrained request's grammar is left past its drafts (the next step's masks walk it back)."""
        record = self._records[req.request_id]
        prediction = record.prediction
        nothing = req.grammar is None and self.spec is None and prediction is None
        if nothing or tokens[-1] in req.stop_token_ids:
            return []  # the default path, once per request and step: nothing can propose
        end = req.num_tokens - req.num_draft_tokens  # verified tokens before this step's
        verified = end + len(tokens)  # once this step is applied
        recent: list[int] = []
        if prediction is not None:
            start = req.num_prompt_tokens + prediction.num_observed
            recent = (req.token_ids[max(req.num_prompt_tokens, end - MATCH_MAX) : end] + tokens)[-MATCH_MAX:]
            prediction.observe(req.token_ids[start:end] + tokens, recent)
        # Room for the drafts and the token sampled after them, within max_tokens and the context.
        room = min(req.max_tokens - (verified - req.num_prompt_tokens), self.max_model_len - verified) - 1
        if room <= 0:
            return []
        drafts: list[int] = []
        grammar = req.grammar
        if grammar is not None:
            if grammar.is_terminated():
                return []
            limit = self.structured.jump_forward_max_running
            if self.structured.enable_jump_forward and (limit is None or num_running <= limit):
                history = req.output_token_ids + tokens
                drafts = grammars.jump_forward(grammar, history, max_tokens=room)
                self.stats.num_jump_forward_tokens += len(drafts)
                record.num_forced = len(drafts)
        if prediction is not None and num_running <= self.prediction_limit:
            want = min(self.prediction_num_drafts, room) - len(drafts)
            more = _before_stop(req, prediction.propose(drafts, recent, want))
            if grammar is not None:
                more = _allowed_prefix(grammar, more)
            if more:
                prediction.span = (len(drafts), len(more))
                drafts = drafts + more
        spec = self.spec
        if spec is None or num_running > spec.max_running_or_unlimited:
            return drafts
        want = min(spec.num_speculative_tokens, room) - len(drafts)
        if want <= 0:
            return drafts
        if self.draft_model is not None:
            # A random request's drafts must be drawn from the q they are verified with, so the
            # grammar cannot cut them afterwards: a constrained one drafts only when greedy.
            if grammar is None or req.params.greedy:
                stops = req.stop_token_ids | (req.eos_token_ids if grammar is not None else frozenset())
                self._queue.append(DraftItem(req, end, list(tokens), list(drafts), want, stops))
            return drafts
        index = record.ngram
        if index is None:
            index = record.ngram = NgramIndex(spec.prompt_lookup_min, spec.prompt_lookup_max)
        index.extend(req.token_ids[len(index.tokens) : end] + tokens)  # the verified tokens it lacks
        more = _before_stop(req, index.propose(want, drafts))
        if grammar is not None:
            more = _allowed_prefix(grammar, more)
        return drafts + more

    def flush(self, sampled: dict[str, SampledTokens]) -> None:
        """Run the draft model for the requests `propose` queued this step (one batch) and append
        its tokens to their drafts. A random request also gets q for every draft (one-hot for
        the drafts of the proposers before the model, which chose them deterministically)."""
        queue, self._queue = self._queue, []
        self._drafted = {item.request.request_id for item in queue}
        if not queue:
            return
        results = self.draft_model.propose(queue)
        for item in queue:
            rid = item.request.request_id
            if rid not in results:
                continue
            more, q = results[rid]
            grammar = item.request.grammar
            if grammar is not None:
                more = _allowed_prefix(grammar, more)  # greedy: any cut is exact
            if not more:
                continue
            res = sampled[rid]
            if q is not None:
                self._records[rid].probs = _span_probs(res.drafts, q[: len(more)])
            res.drafts = res.drafts + more

    def end_step(self, running: Iterable[str]) -> None:
        """After the scheduler applied the step: the draft model keeps KV only for the requests
        it drafted for and that still run."""
        if self.draft_model is not None:
            self.draft_model.end_step(self._drafted.intersection(running))

    def reset_prefix_cache(self) -> None:
        if self.draft_model is not None:
            self.draft_model.kv.reset_prefix_cache()

    def check(self, live: Collection[str], running: Iterable[str]) -> None:
        """Exactly the live requests (waiting or running) have records; the draft pool's
        accounting."""
        if self._records.keys() != set(live):
            stale, missing = set(self._records).difference(live), set(live).difference(self._records)
            raise AssertionError(f"drafting records: of ended requests {stale}, missing {missing}")
        if self.draft_model is not None:
            self.draft_model.check(running)


def _span_probs(before: list[int], q: torch.Tensor) -> torch.Tensor:
    """q for a whole draft span: one-hot rows for the deterministic drafts before the model's."""
    if not before:
        return q
    onehot = torch.zeros(len(before), q.shape[1], dtype=q.dtype, device=q.device)
    onehot[torch.arange(len(before)), torch.tensor(before)] = 1.0
    return torch.cat([onehot, q])


def _allowed_prefix(grammar, drafts: list[int]) -> list[int]:
    """The drafts the grammar accepts in order (it is left past them)."""
    for i, token in enumerate(drafts):
        if grammar.is_terminated() or not grammar.accept_token(token):
            return drafts[:i]
    return drafts


def _before_stop(req: Request, drafts: list[int]) -> list[int]:
    """The drafts before the first token that would end the sequence: that one is sampled, never
    drafted (a request's grammar ends on it, and nothing after it is kept)."""
    stops = req.stop_token_ids
    for i, token in enumerate(drafts):
        if token in stops or (req.grammar is not None and token in req.eos_token_ids):
            return drafts[:i]
    return drafts
