"""pagoda: a small, fast LLM inference and serving engine."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# Imported on first use, so `import pagoda.<light module>` and `pagoda --help` stay fast.
_EXPORTS = {
    "LLM": "pagoda.entrypoints.llm",
    "CompletionOutput": "pagoda.outputs",
    "Logprob": "pagoda.outputs",
    "RequestLimits": "pagoda.limits",
    "RequestOutput": "pagoda.outputs",
    "SamplingParams": "pagoda.sampling_params",
    "StructuredOutputs": "pagoda.sampling_params",
}
__all__ = [
    "LLM",
    "CompletionOutput",
    "Logprob",
    "RequestLimits",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputs",
]

if TYPE_CHECKING:
    from pagoda.entrypoints.llm import LLM
    from pagoda.limits import RequestLimits
    from pagoda.outputs import CompletionOutput, Logprob, RequestOutput
    from pagoda.sampling_params import SamplingParams, StructuredOutputs


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pagoda' has no attribute {name!r}")
