"""The small interface every grammar backend implements (xgrammar today, llguidance could plug in later).

Bitmask layout (shared by xgrammar and llguidance): an int32 CPU tensor of shape [batch, ceil(V / 32)],
bit ``j % 32`` of word ``j // 32`` set when token ``j`` is allowed; V is the model's vocab size (lm_head rows).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from pagoda.sampling_params import StructuredOutputs


class GrammarMatcher(Protocol):
    """Grammar state of one sequence. Not thread-safe: one owner (the engine loop) at a time."""

    @property
    def num_accepted_tokens(self) -> int:
        """Tokens accepted since creation (or reset) and not rolled back: the most ``rollback`` may undo."""
        ...

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) when the grammar does not allow it here."""
        ...

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]``; stop tokens only where the grammar may end."""
        ...

    def is_terminated(self) -> bool:
        """True once a stop token has been accepted."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (ValueError if more than were accepted)."""
        ...

    def jump_forward_string(self) -> str:
        """The continuation the grammar forces from here (whole UTF-8 characters), "" if none."""
        ...

    def reset(self) -> None:
        """Back to the initial state."""
        ...


class CompiledGrammar(Protocol):
    """A grammar compiled against one tokenizer; immutable and shareable between sequences and threads."""

    def new_matcher(self) -> GrammarMatcher: ...


class GrammarBackend(Protocol):
    """One per engine (per tokenizer). ``compile`` may run on worker threads concurrently."""

    @property
    def vocab_size(self) -> int:
        """Columns of the logits the bitmask covers (the model's vocab size, may exceed the tokenizer's)."""
        ...

    @property
    def token_bytes(self) -> Sequence[bytes]:
        """UTF-8 bytes each token id decodes to; b"" for special, stop and padding ids (never forced)."""
        ...

    def compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        """Compile ``spec``; raises ValueError naming the problem for an invalid schema, regex or grammar."""
        ...

    def fill_bitmasks(
        self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor, rows: Sequence[int]
    ) -> None:
        """``matchers[i].fill_bitmask(bitmask, rows[i])`` for all i, batched where the backend can."""
        ...
