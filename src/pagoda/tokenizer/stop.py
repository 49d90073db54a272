"""Stop-string detection over a stream of text deltas."""

from __future__ import annotations

from collections.abc import Sequence


class StopStringChecker:
    """Finds the first stop string in streamed text and decides what text may be released.

    The stop string that completes first (the earliest end in the text, the longest one on a tie) wins, so
    the result does not depend on how the text was split into deltas. Without
    ``include_stop_str_in_output`` the released text ends before the stop string, and only a trailing
    piece of text that could still grow into a stop string is held back; with it, nothing is held back
    and the released text ends with the stop string.
    """

    def __init__(self, stop: Sequence[str] | None, include_stop_str_in_output: bool = False) -> None:
        stops = [stop] if isinstance(stop, str) else list(stop or ())
        for i, s in enumerate(stops):
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings; stop[{i}] is {s!r}")
        self._stops: tuple[str, ...] = tuple(dict.fromkeys(stops))
        self._include = include_stop_str_in_output
        self._tail_len = max((len(s) for s in self._stops), default=1) - 1
        # Every proper prefix of a stop string: the text that may still become a stop string.
        self._prefixes = frozenset(s[:k] for s in self._stops for k in range(1, len(s)))
        self._tail = ""  # the last _tail_len characters seen, to catch stop strings spanning deltas
        self._held = 0  # how many characters at the end of _tail are not released yet
        self._stop_str: str | None = None

    @property
    def stop_str(self) -> str | None:
        """The stop string that was hit, or None."""
        return self._stop_str

    def feed(self, delta: str, check: bool = True) -> tuple[str, str | None]:
        """Consumes a text delta; returns (text that may be released now, the stop string hit or None).

        With ``check=False`` the delta is released as is and no stop string may start inside it (used
        before ``min_tokens`` is reached).
        """
        if self._stop_str is not None:
            raise ValueError(f"StopStringChecker.feed() called after stop string {self._stop_str!r} was hit")
        if not self._stops:
            return delta, None
        if not check:
            released = self._tail[len(self._tail) - self._held :] + delta
            self._tail, self._held = "", 0
            return released, None
        buf = self._tail + delta
        unreleased_from = len(self._tail) - self._held
        hit = self._find_first(buf, len(self._tail))
        if hit is not None:
            start, stop_str = hit
            self._stop_str = stop_str
            cut = start + len(stop_str) if self._include else start
            self._tail, self._held = "", 0
            return buf[unreleased_from:cut], stop_str
        hold = 0 if self._include else self._partial_suffix_len(buf)
        keep_from = max(len(buf) - hold, unreleased_from)
        released = buf[unreleased_from:keep_from]
        self._tail = buf[max(0, len(buf) - self._tail_len) :] if self._tail_len else ""
        self._held = len(buf) - keep_from
        return released, None

    def flush(self) -> str:
        """Ends the stream without a stop: returns the held-back text."""
        if self._stop_str is not None:
            return ""
        released = self._tail[len(self._tail) - self._held :]
        self._tail, self._held = "", 0
        return released

    def _find_first(self, buf: str, old_len: int) -> tuple[int, str] | None:
        """The stop string occurrence in ``buf`` ending earliest past ``old_len`` (longest on a tie)."""
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for s in self._stops:
            idx = buf.find(s, max(0, old_len - len(s) + 1))
            if idx < 0:
                continue
            cand = (idx + len(s), idx, s)
            if best is None or cand[:2] < best[:2]:
                best = cand
        return None if best is None else (best[1], best[2])

    def _partial_suffix_len(self, buf: str) -> int:
        for k in range(min(self._tail_len, len(buf)), 0, -1):
            if buf[len(buf) - k :] in self._prefixes:
                return k
        return 0
