"""Routing policies: which of a model's healthy backends gets the next request.

Every policy sees only the candidates (healthy backends serving the request's model, in config order)
and their in-flight counts, and returns a `Decision`. Decisions are deterministic given the call
sequence (power-of-two takes a seed), so they are unit-tested without a network.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

from pagoda.router.prefix_tree import PrefixTree


class Candidate(Protocol):
    """What a policy needs to know about a backend."""

    @property
    def url(self) -> str: ...

    @property
    def in_flight(self) -> int: ...


@dataclass(frozen=True)
class Decision:
    backend: Candidate
    reason: str  # a short label for metrics and logs, e.g. "cache_hit"


@dataclass(frozen=True)
class CacheAwareConfig:
    """Thresholds of the cache-aware policy (see docs/router.md)."""

    # Route to the backend with the longest prefix match only if it covers this fraction of the text.
    cache_threshold: float = 0.5
    # Load is "too uneven" when max - min in-flight exceeds this absolute gap ...
    balance_abs_threshold: int = 16
    # ... and max in-flight also exceeds min in-flight times this ratio.
    balance_rel_threshold: float = 1.5
    # Bound on the characters kept in each model's prefix tree.
    max_tree_chars: int = 8 * 1024 * 1024

    def __post_init__(self) -> None:
        if not _is_number(self.cache_threshold) or not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be a number in [0, 1], got {self.cache_threshold!r}")
        if not _is_int(self.balance_abs_threshold) or self.balance_abs_threshold < 0:
            raise ValueError(
                f"balance_abs_threshold must be an integer >= 0, got {self.balance_abs_threshold!r}"
            )
        if not _is_number(self.balance_rel_threshold) or self.balance_rel_threshold < 1.0:
            raise ValueError(
                f"balance_rel_threshold must be a number >= 1, got {self.balance_rel_threshold!r}"
            )
        if not _is_int(self.max_tree_chars) or self.max_tree_chars < 1:
            raise ValueError(f"max_tree_chars must be an integer >= 1, got {self.max_tree_chars!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class Policy(ABC):
    name: ClassVar[str]
    uses_text: ClassVar[bool] = False  # whether `choose` looks at the request text

    @abstractmethod
    def choose(self, model: str, text: str, candidates: Sequence[Candidate]) -> Decision:
        """Pick one of `candidates` (non-empty) for a request to `model` whose prompt text is `text`."""

    def forget_backend(self, url: str) -> None:
        """Drop per-backend state after `url` was taken out of rotation (stateless policies keep none)."""
        return None


class _Rotation:
    """A per-model counter; used as round-robin position and as tie-breaker so ties spread out."""

    def __init__(self) -> None:
        self._next: dict[str, int] = {}

    def take(self, model: str, n: int) -> int:
        index = self._next.get(model, 0) % n
        self._next[model] = index + 1
        return index


def _least_loaded(candidates: Sequence[Candidate], start: int) -> Candidate:
    """Fewest in-flight requests; among ties the first at or after position `start` (wrapping)."""
    n = len(candidates)
    return min((candidates[(start + k) % n] for k in range(n)), key=lambda c: c.in_flight)


def _require_candidates(candidates: Sequence[Candidate]) -> None:
    if not candidates:
        raise ValueError("a routing policy needs at least one candidate backend")


class RoundRobinPolicy(Policy):
    name = "round-robin"

    def __init__(self) -> None:
        self._rotation = _Rotation()

    def choose(self, model: str, text: str, candidates: Sequence[Candidate]) -> Decision:
        _require_candidates(candidates)
        return Decision(candidates[self._rotation.take(model, len(candidates))], "round_robin")


class LeastLoadPolicy(Policy):
    name = "least-load"

    def __init__(self) -> None:
        self._rotation = _Rotation()

    def choose(self, model: str, text: str, candidates: Sequence[Candidate]) -> Decision:
        _require_candidates(candidates)
        start = self._rotation.take(model, len(candidates))
        return Decision(_least_loaded(candidates, start), "least_load")


class PowerOfTwoPolicy(Policy):
    """Sample two distinct candidates at random, keep the less loaded (the first sampled on a tie)."""

    name = "power-of-two"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, model: str, text: str, candidates: Sequence[Candidate]) -> Decision:
        _require_candidates(candidates)
        if len(candidates) == 1:
            return Decision(candidates[0], "only_candidate")
        first, second = self._rng.sample(range(len(candidates)), 2)
        a, b = candidates[first], candidates[second]
        return Decision(b if b.in_flight < a.in_flight else a, "power_of_two")


class CacheAwarePolicy(Policy):
    """Longest-prefix-match routing with a load-balance override; see docs/router.md."""

    name = "cache-aware"
    uses_text = True

    def __init__(self, config: CacheAwareConfig | None = None) -> None:
        self.config = config or CacheAwareConfig()
        self._trees: dict[str, PrefixTree] = {}
        self._rotation = _Rotation()

    def tree(self, model: str) -> PrefixTree:
        tree = self._trees.get(model)
        if tree is None:
            tree = self._trees[model] = PrefixTree(self.config.max_tree_chars)
        return tree

    def is_imbalanced(self, candidates: Sequence[Candidate]) -> bool:
        loads = [c.in_flight for c in candidates]
        low, high = min(loads), max(loads)
        return (
            high - low > self.config.balance_abs_threshold and high > low * self.config.balance_rel_threshold
        )

    def choose(self, model: str, text: str, candidates: Sequence[Candidate]) -> Decision:
        _require_candidates(candidates)
        start = self._rotation.take(model, len(candidates))
        tree = self.tree(model)
        if not text:
            decision = Decision(_least_loaded(candidates, start), "no_text")
        elif self.is_imbalanced(candidates):
            decision = Decision(_least_loaded(candidates, start), "balance")
        else:
            matched = tree.match(text)
            # Longest match first; among equal matches the less loaded; then config order.
            best = max(candidates, key=lambda c: (matched.get(c.url, 0), -c.in_flight))
            if matched.get(best.url, 0) >= self.config.cache_threshold * len(text) and best.url in matched:
                decision = Decision(best, "cache_hit")
            else:
                decision = Decision(_least_loaded(candidates, start), "cache_miss")
        if text:
            tree.insert(text, decision.backend.url)
        return decision

    def forget_backend(self, url: str) -> None:
        for tree in self._trees.values():
            tree.remove_tenant(url)


POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (RoundRobinPolicy, LeastLoadPolicy, PowerOfTwoPolicy, CacheAwarePolicy)
}
DEFAULT_POLICY = CacheAwarePolicy.name


def make_policy(name: str, cache_aware: CacheAwareConfig | None = None, seed: int | None = None) -> Policy:
    """Build the policy called `name`; `cache_aware` only applies to cache-aware, `seed` to power-of-two."""
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {sorted(POLICIES)}")
    if name == CacheAwarePolicy.name:
        return CacheAwarePolicy(cache_aware)
    if name == PowerOfTwoPolicy.name:
        return PowerOfTwoPolicy(seed)
    return POLICIES[name]()
