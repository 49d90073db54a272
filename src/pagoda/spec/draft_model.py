"""The draft-model proposer: a small model sharing the target's tokenizer proposes the next K tokens
of the requests under the load gate, batched, each step.

Ownership: `DraftModelProposer` owns the draft model (a `Worker` on rank 0, unsharded even under
tensor parallelism, loaded in the target's dtype on its device), the draft's own paged KV pool
(the same block size and block count as the target's, so the same number of tokens, each block of
the draft's layer shapes; the same attention backend) and a `KVCacheManager` of its own with the
prefix cache on. It holds a KV record only for the requests it drafted for in the last step
(`_seqs`): every other one (finished, aborted, preempted, over the gate, or not sampling) is
released at the end of the step (`end_step`, or `release` on an abort), its verified blocks left
in the draft's prefix cache.

Per step, for the gated requests: each `_DraftSeq` is rolled back to the tokens it shares with the
request's verified tokens (plus earlier proposers' drafts), its blocks past them given back; a new
one starts from the draft's prefix cache. Then forward passes of at most `max_tokens` tokens catch
each sequence up on the tokens it has not computed (chunked) and, once caught up, decode one draft
token a pass until it has its K: greedy requests take the argmax, others draw from q, the draft's
distribution after the request's temperature, top-k, top-p and min-p (and without the tokens that
would end the sequence: drafts end before them), and q is kept for the rejection sampler. Only
verified tokens enter the draft's prefix cache.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from pagoda.cache.kv_manager import KVCacheManager
from pagoda.config import CacheConfig, ModelConfig
from pagoda.request import Request
from pagoda.sample.filters import apply_min_p, apply_top_k_top_p
from pagoda.worker.batch import ForwardBatch
from pagoda.worker.worker import Worker

logger = logging.getLogger(__name__)

_TOP_P_CANDIDATES = 1024


@dataclass
class DraftItem:
    """One request to draft for: its verified tokens are `request.token_ids[:end] + tokens`, then
    `drafts` (earlier proposers'), then up to `want` tokens from the draft model."""

    request: Request
    end: int
    tokens: list[int]
    drafts: list[int]
    want: int
    stops: frozenset[int]


@dataclass
class _DraftSeq:
    """The draft's view of one request: the tokens its KV stands for. It offers what the KV manager
    reads of a request (id, token ids, salt, sibling, computed count, cacheable count)."""

    request_id: str
    token_ids: list[int]
    cache_salt: str | None
    num_verified: int  # the leading token_ids the target verified: only these are ever cached
    num_computed_tokens: int = 0
    fork_source: None = None
    prompt_source: None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_cacheable_tokens(self) -> int:
        return len(self.token_ids) - 1


@dataclass(eq=False)  # compared by identity
class _Run:
    """A sequence in this step's passes."""

    seq: _DraftSeq
    item: DraftItem
    drafts: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)  # q per draft, random requests only


class DraftModelProposer:
    def __init__(self, model: ModelConfig, cache: CacheConfig, max_tokens: int) -> None:
        self.device = model.device
        self.block_size = cache.block_size
        self.max_tokens = max_tokens  # per forward pass
        self.worker = Worker(model, cache)
        self.vocab_size = self.worker.vocab_size
        pool = sum(c.numel() * c.element_size() for c in self.worker.kv_caches)
        logger.info(
            "draft model %s: KV pool of %d blocks of %d tokens (%.1f MiB, beside the target's)",
            model.path,
            cache.num_blocks,
            cache.block_size,
            pool / 2**20,
        )
        self.kv = KVCacheManager(cache.num_blocks, cache.block_size, enable_prefix_caching=True)
        self.generator = torch.Generator(device=model.device).manual_seed(model.seed)
        self._seqs: dict[str, _DraftSeq] = {}
        self.num_forward_passes = 0
        self.num_pool_full = 0  # times a request got fewer drafts because the draft pool was full

    # ---- one step --------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, items: list[DraftItem]) -> dict[str, tuple[list[int], torch.Tensor | None]]:
        """Request id -> (the draft model's tokens, q [len, vocab] float32 for a random request,
        else None), for the items it could draft for (a full draft pool skips some)."""
        runs = []
        for item in items:
            seq = self._attach(item)
            if seq is not None:
                runs.append(_Run(seq, item))
        active = [r for r in runs if r.item.want > 0]
        while active:
            active = self._pass(active)
        return {
            r.seq.request_id: (r.drafts, torch.stack(r.probs) if r.probs else None) for r in runs if r.drafts
        }

    def _attach(self, item: DraftItem) -> _DraftSeq | None:
        """The request's draft sequence, rolled back to what it shares with the item's tokens."""
        req = item.request
        verified = item.end + len(item.tokens)
        seq = self._seqs.get(req.request_id)
        if seq is None:
            tokens = req.token_ids[: item.end] + item.tokens + item.drafts
            seq = _DraftSeq(req.request_id, tokens, req.cache_salt, verified)
            alloc = self.kv.allocate_first(seq, 0)  # the draft's prefix cache first
            if alloc is None:
                self.num_pool_full += 1
                return None
            seq.num_computed_tokens = alloc.num_computed
            self._seqs[req.request_id] = seq
            return seq
        # Verified tokens never change: only what follows the old verified ones can differ.
        old = seq.num_verified
        new = req.token_ids[old : item.end] + item.tokens + item.drafts
        same = old
        for a, b in zip(seq.token_ids[old:], new, strict=False):
            if a != b:
                break
            same += 1
        del seq.token_ids[old:]
        seq.token_ids.extend(new)
        seq.num_verified = verified
        # The last token is always fed again (its logits propose the next draft), so each pass
        # computes at least one token of every sequence it takes.
        seq.num_computed_tokens = min(seq.num_computed_tokens, same, seq.num_tokens - 1)
        self._cache_verified(seq)
        self.kv.trim(seq)  # the blocks that held only tokens it no longer has
        return seq

    def _pass(self, active: list[_Run]) -> list[_Run]:
        """One forward pass: the caught-up sequences decode a token, the others catch up (in
        chunks within the pass's budget). Returns the runs that want more."""
        decoding = [r for r in active if r.seq.num_tokens - r.seq.num_computed_tokens == 1]
        budget = max(self.max_tokens - len(decoding), 1)
        chunks: list[tuple[_Run, int]] = []
        later: list[_Run] = []  # catching up, but the pass is full: the next one
        for r in decoding + [r for r in active if r not in decoding]:
            seq = r.seq
            n = seq.num_tokens - seq.num_computed_tokens
            if r not in decoding:
                n = min(n, budget)
                if n <= 0:
                    later.append(r)
                    continue
                budget -= n
            if not self.kv.allocate_more(seq, n):
                self._give_up(r)  # the draft pool is full: no drafts for this one this step
                continue
            chunks.append((r, n))
        if not chunks:
            return later  # every one gave up (then nothing waits: the budget was not spent)
        chunks.sort(key=lambda c: c[1])
        parts, rows, sampling = [], [], []
        flat = 0
        for r, n in chunks:
            seq = r.seq
            start = seq.num_computed_tokens
            parts.append((seq.token_ids[start : start + n], start, self.kv.block_ids(seq.request_id)))
            flat += n
            if start + n == seq.num_tokens:
                rows.append(flat - 1)
                sampling.append(r)
        batch = ForwardBatch.build(parts, self.block_size, rows, self.kv.take_copies())
        logits = self.worker.execute(batch)
        self.num_forward_passes += 1
        for r, n in chunks:
            r.seq.num_computed_tokens += n
        still = later + [r for r, _ in chunks if r not in sampling]
        for i, r in enumerate(sampling):
            token = self._pick(r, logits[i])
            if token is None:
                continue  # the draft would end the sequence: drafts end here
            r.drafts.append(token)
            r.seq.token_ids.append(token)
            if len(r.drafts) < r.item.want:
                still.append(r)
        return still

    def _pick(self, r: _Run, logits: torch.Tensor) -> int | None:
        """The next draft token of `r` from its logits row (None: it would be a stop token)."""
        params = r.item.request.params
        stops = r.item.stops
        if params.greedy:
            token = int(logits.argmax())
            return None if token in stops else token
        probs = torch.softmax(logits.float().unsqueeze(0) / params.temperature, dim=-1)
        vocab = probs.shape[-1]
        top_k = params.top_k if params.top_k > 0 else vocab
        if top_k < vocab or params.top_p < 1.0:
            apply_top_k_top_p(
                probs,
                torch.tensor([top_k], device=probs.device) if top_k < vocab else None,
                top_k if top_k < vocab else 0,
                torch.tensor([params.top_p], device=probs.device) if params.top_p < 1.0 else None,
                _TOP_P_CANDIDATES,
                top_p_within_top_k=top_k < vocab,
            )
        if params.min_p > 0.0:
            apply_min_p(probs, torch.tensor([params.min_p], device=probs.device))
        if stops:
            probs[0, [t for t in stops if t < vocab]] = 0.0
        total = float(probs.sum())
        if total <= 0.0:
            return None
        q = probs[0] / total
        token = int(torch.multinomial(q, 1, generator=self.generator))
        r.probs.append(q)
        return token

    def _give_up(self, r: _Run) -> None:
        self.num_pool_full += 1
        r.item.want = len(r.drafts)
        self.release([r.seq.request_id])

    # ---- ownership -------------------------------------------------------------------------------
    def _cache_verified(self, seq: _DraftSeq, *, final: bool = False) -> None:
        """Insert the sequence's computed verified blocks into the draft's prefix cache (never
        blocks holding drafts: their tokens may yet be rejected)."""
        computed = seq.num_computed_tokens
        seq.num_computed_tokens = min(computed, seq.num_verified)
        self.kv.cache(seq, final=final)
        seq.num_computed_tokens = computed

    def release(self, request_ids: Iterable[str]) -> None:
        """Free the draft KV of these requests (their verified blocks stay in the prefix cache)."""
        for rid in request_ids:
            seq = self._seqs.pop(rid, None)
            if seq is None:
                continue
            seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_verified)
            self.kv.cache(seq, final=True)
            self.kv.free(rid)

    def end_step(self, keep: set[str]) -> None:
        """After a step: only the requests drafted for in it (and still running) keep draft KV."""
        self.release([rid for rid in self._seqs if rid not in keep])

    @property
    def num_records(self) -> int:
        return len(self._seqs)

    def check(self, live_request_ids: Iterable[str]) -> None:
        """The draft pool's block accounting, and that only live requests hold draft blocks."""
        self.kv.check(live_request_ids)
        self.kv.check(self._seqs)
