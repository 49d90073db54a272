"""pagoda.lang: SGLang's frontend language (gen / select / fork) over pagoda's prefix cache.

    import pagoda.lang as pl

    @pl.function
    def qa(s, question):
        s += pl.user(question)
        s += pl.assistant(pl.gen("answer", max_tokens=64))

    pl.set_default_backend(pl.Engine(model="path/to/model"))   # or pl.RuntimeEndpoint(url)
    print(qa.run(question="Why is the sky blue?")["answer"])

The names are SGLang's, so its programs port by changing the import. See docs/lang.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from pagoda.lang.api import (
    assistant,
    assistant_begin,
    assistant_end,
    flush_cache,
    function,
    gen,
    gen_int,
    gen_string,
    select,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
)
from pagoda.lang.choices import (
    ChoicesDecision,
    ChoicesSamplingMethod,
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from pagoda.lang.errors import BackendCapabilityError, BackendRequestError, UndefinedVariableError
from pagoda.lang.interpreter import ProgramState, ProgramStateGroup
from pagoda.lang.program import Function, get_default_backend, set_default_backend

# The backends load the engine or an HTTP client only when named.
_BACKENDS = {
    "Engine": "pagoda.lang.backend.engine",
    "RuntimeEndpoint": "pagoda.lang.backend.runtime_endpoint",
}

if TYPE_CHECKING:
    from pagoda.lang.backend.engine import Engine
    from pagoda.lang.backend.runtime_endpoint import RuntimeEndpoint


def __getattr__(name: str):
    if name in _BACKENDS:
        return getattr(importlib.import_module(_BACKENDS[name]), name)
    raise AttributeError(f"module 'pagoda.lang' has no attribute {name!r}")


__all__ = [
    "BackendCapabilityError",
    "BackendRequestError",
    "ChoicesDecision",
    "ChoicesSamplingMethod",
    "Engine",
    "Function",
    "ProgramState",
    "ProgramStateGroup",
    "RuntimeEndpoint",
    "UndefinedVariableError",
    "assistant",
    "assistant_begin",
    "assistant_end",
    "flush_cache",
    "function",
    "gen",
    "gen_int",
    "gen_string",
    "get_default_backend",
    "greedy_token_selection",
    "select",
    "set_default_backend",
    "system",
    "system_begin",
    "system_end",
    "token_length_normalized",
    "unconditional_likelihood_normalized",
    "user",
    "user_begin",
    "user_end",
]
