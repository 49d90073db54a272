"""Speculative decoding: proposers that write a request's draft tokens. The target model verifies
every draft position in the next step's one forward pass and one sampler call (sample/sampler.py
`DraftSpan`); the scheduler budgets drafts like any other tokens and settles them after the step."""

from pagoda.spec.drafter import Drafter, SpecDecodeStats
from pagoda.spec.ngram import ngram_propose
from pagoda.spec.prediction import Prediction

__all__ = ["Drafter", "Prediction", "SpecDecodeStats", "ngram_propose"]
