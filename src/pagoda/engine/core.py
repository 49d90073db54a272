"""The engine core: a scheduler, a KV cache and a model runner, stepped in one loop."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagoda.cache.kv_manager import KVCacheManager
from pagoda.config import EngineConfig
from pagoda.outputs import Logprob
from pagoda.request import Request
from pagoda.sample.metadata import make_generator
from pagoda.scheduler.scheduler import Scheduler
from pagoda.step import SampledTokens
from pagoda.structured import GrammarManager
from pagoda.worker.model_runner import ModelRunner


@dataclass
class StepOutput:
    request: Request
    new_token_ids: list[int]
    new_logprobs: list[dict[int, Logprob]] | None


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = config.model.device
        self.runner = ModelRunner(config.model, config.cache)
        cache = config.cache
        self.kv = KVCacheManager(cache.num_blocks, cache.block_size, cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv)
        self.grammars: GrammarManager | None = None  # set by the engine on first structured request
        self.num_jump_forward_tokens = 0  # drafts proposed
        self.num_jump_forward_accepted = 0  # drafts that sampling confirmed

    # ---- requests --------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.params.seed is not None and not request.params.greedy:
            request.generator = make_generator(request.params.seed, self.device)
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> list[Request]:
        return self.scheduler.finish_requests(request_ids, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # ---- the loop --------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        sched = self.scheduler.schedule()
        if sched.is_empty:
            if self.scheduler.waiting and not self.scheduler.running:
                raise RuntimeError(
                    f"the scheduler cannot start {self.scheduler.waiting[0]} with an idle engine"
                )
            return []
        result = self.runner.execute(sched, self._fill_bitmask if self.grammars else None)
        requests = self.scheduler.requests
        sampled: dict[str, SampledTokens] = {}
        logprobs: dict[str, list[dict[int, Logprob]]] = {}
        for rid, tok in result.sampled.items():
            sampled[rid] = SampledTokens([tok])
            if rid in result.logprobs:
                logprobs[rid] = [result.logprobs[rid]]
            if requests[rid].grammar is not None:
                self._accept(requests[rid], tok)
        for rid, draft_logits in result.draft_logits.items():
            sampled[rid], logprobs[rid] = self._verify_drafts(requests[rid], draft_logits)
        for rid, res in sampled.items():
            if requests[rid].grammar is not None:
                res.drafts = self._jump_forward(requests[rid], res.tokens)
        verified = {rid: requests[rid].num_tokens - requests[rid].num_draft_tokens for rid in sampled}
        changed = self.scheduler.update_from_output(sched, sampled)
        outputs = []
        for req in changed:
            new = req.token_ids[verified[req.request_id] : req.num_tokens - req.num_draft_tokens]
            lp = logprobs.get(req.request_id)
            outputs.append(StepOutput(req, new, lp[: len(new)] if lp else None))
        return outputs

    # ---- structured output -----------------------------------------------------------------------
    def _fill_bitmask(self, batch: list[Request]) -> torch.Tensor | None:
        if all(r.grammar is None for r in batch):
            return None
        bitmask = self.grammars.allocate_bitmask(len(batch))
        self.grammars.fill_bitmask(bitmask, [r.grammar for r in batch])
        return bitmask.to(self.device, non_blocking=True)

    def _accept(self, req: Request, token: int) -> None:
        if not req.grammar.accept_token(token):
            raise RuntimeError(f"{req.request_id}: sampled token {token} violates its grammar")

    def _verify_drafts(self, req: Request, logits: torch.Tensor) -> tuple[SampledTokens, list]:
        """Sample at each draft position in order, exactly as decoding one token per step would
        (same masks, penalties and random draws); keep drafts while the samples agree with them."""
        k = req.num_draft_tokens
        drafts = req.token_ids[-k:]
        req.grammar.rollback(k)
        history = req.output_token_ids
        tokens: list[int] = []
        logprobs: list[dict[int, Logprob]] = []
        for i in range(k + 1):
            sampled, lps = self.runner.sample(
                logits[i : i + 1], [req], self._fill_bitmask([req]), [history + tokens]
            )
            tok = sampled[req.request_id]
            self._accept(req, tok)
            tokens.append(tok)
            if req.request_id in lps:
                logprobs.append(lps[req.request_id])
            if i == k or tok != drafts[i]:
                break
        self.num_jump_forward_accepted += len(tokens) - 1
        return SampledTokens(tokens, num_accepted_drafts=len(tokens) - 1), logprobs

    def _jump_forward(self, req: Request, tokens: list[int]) -> list[int]:
        """Tokens the grammar forces after `tokens`, proposed as drafts for the next step."""
        limit = self.config.structured.jump_forward_max_running
        if (
            not self.config.structured.enable_jump_forward
            or (limit is not None and len(self.scheduler.running) > limit)
            or req.grammar.is_terminated()
            or tokens[-1] in req.stop_token_ids
        ):
            return []
        verified = req.num_tokens - req.num_draft_tokens + len(tokens)  # once this step is applied
        room = (
            min(req.max_tokens - (verified - req.num_prompt_tokens), self.config.max_model_len - verified) - 1
        )
        if room <= 0:
            return []
        history = req.output_token_ids + tokens
        forced = self.grammars.jump_forward(req.grammar, history, max_tokens=room)
        self.num_jump_forward_tokens += len(forced)
        return forced

    def reset_prefix_cache(self) -> int:
        return self.kv.reset_prefix_cache()

    def check_invariants(self) -> None:
        self.scheduler.check()
