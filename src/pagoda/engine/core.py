"""The engine core: a scheduler, a KV cache and a model runner, stepped in one loop."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pagoda.cache.kv_manager import KVCacheManager
from pagoda.config import EngineArgs, resolve_device, resolve_dtype
from pagoda.outputs import Logprob
from pagoda.request import Request
from pagoda.sample.metadata import make_generator
from pagoda.scheduler.scheduler import Scheduler
from pagoda.structured import GrammarManager
from pagoda.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclass
class StepOutput:
    request: Request
    new_token_ids: list[int]
    new_logprobs: list[dict[int, Logprob]] | None


class EngineCore:
    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        self.device = resolve_device(args.device)
        self.dtype = resolve_dtype(args.dtype, args.model)
        cache = args.cache_config()
        self.runner = ModelRunner(args.model, self.dtype, self.device, cache.block_size, args.seed)
        arch = self.runner.arch
        num_blocks = cache.num_kv_blocks or max(
            1, int(cache.kv_cache_memory_gb * 2**30) // self.runner.kv_bytes_per_block()
        )
        max_model_len = args.max_model_len or arch.max_position_embeddings
        if max_model_len > arch.max_position_embeddings:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
                f"{arch.max_position_embeddings}"
            )
        capacity = num_blocks * cache.block_size
        if max_model_len > capacity:
            logger.warning("max_model_len %d lowered to %d, what the KV pool holds", max_model_len, capacity)
            max_model_len = capacity
        self.max_model_len = max_model_len
        self.runner.allocate_kv_cache(num_blocks)
        self.kv = KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching)
        self.scheduler = Scheduler(args.scheduler_config(max_model_len), self.kv)
        self.grammars: GrammarManager | None = None  # set by the engine on first structured request
        self.num_jump_forward_tokens = 0

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
        before = {rid: requests[rid].num_tokens for rid in result.sampled}
        sampled = {rid: [tok] for rid, tok in result.sampled.items()}
        if self.grammars is not None:
            for rid, tokens in sampled.items():
                if requests[rid].grammar is not None:
                    tokens += self._advance_grammar(requests[rid], tokens[0])
        changed = self.scheduler.update_from_output(sched, sampled)
        outputs = []
        for req in changed:
            new = req.token_ids[before[req.request_id] :]
            lp = result.logprobs.get(req.request_id)
            outputs.append(StepOutput(req, new, [lp] if lp is not None else None))
        return outputs

    def _fill_bitmask(self, batch: list[Request]) -> torch.Tensor | None:
        if all(r.grammar is None for r in batch):
            return None
        bitmask = self.grammars.allocate_bitmask(len(batch))
        self.grammars.fill_bitmask(bitmask, [r.grammar for r in batch])
        return bitmask.to(self.device, non_blocking=True)

    def _advance_grammar(self, req: Request, token: int) -> list[int]:
        """Accept the sampled token; returns the tokens the grammar forces next (jump-forward)."""
        if not req.grammar.accept_token(token):
            raise RuntimeError(f"{req.request_id}: sampled token {token} violates its grammar")
        if req.grammar.is_terminated() or token in req.stop_token_ids:
            return []
        if not self.args.enable_jump_forward or req.params.logprobs is not None:
            return []  # forced tokens have no sampled logprobs to report
        room = min(req.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens) - 1
        if room <= 0:
            return []
        forced = self.grammars.jump_forward(req.grammar, req.output_token_ids + [token], max_tokens=room)
        self.num_jump_forward_tokens += len(forced)
        return forced

    def reset_prefix_cache(self) -> int:
        return self.kv.reset_prefix_cache()

    def check_invariants(self) -> None:
        self.scheduler.check()
