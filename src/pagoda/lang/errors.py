"""The language's own errors: each names what is missing."""

from __future__ import annotations

from collections.abc import Iterable


class UndefinedVariableError(KeyError):
    """`s["name"]` read a variable that no gen/select produced and no `s["name"] = ...` set."""

    def __init__(self, name: str, defined: Iterable[str]) -> None:
        super().__init__(name)
        self.name = name
        self.defined = sorted(defined)

    def __str__(self) -> str:
        known = ", ".join(map(repr, self.defined)) or "none"
        return (
            f"variable {self.name!r} is not defined in this program state: no pl.gen/pl.select named "
            f"{self.name!r} has run here and it was not set with s[{self.name!r}] = ...; defined: {known}"
        )


class BackendCapabilityError(RuntimeError):
    """The backend cannot do what a call needs; the message names the backend, the call and the need."""

    def __init__(self, backend: str, call: str, need: str) -> None:
        super().__init__(f"{backend} cannot do {call}: needs {need}")
        self.backend = backend
        self.call = call
        self.need = need


class BackendRequestError(RuntimeError):
    """A backend request failed for a reason other than a bad parameter (server error, engine stopped)."""
