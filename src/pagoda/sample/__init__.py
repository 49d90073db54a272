"""Batched sampling: penalties → grammar mask → temperature → top-k / top-p / min-p → seeded draw → logprobs."""

from pagoda.sample.logprobs import LogprobsTensors
from pagoda.sample.metadata import SamplingMetadata, SamplingRow, make_generator
from pagoda.sample.sampler import DraftSpan, Sampler, SamplerOutput

__all__ = [
    "DraftSpan",
    "LogprobsTensors",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "SamplingRow",
    "make_generator",
]
