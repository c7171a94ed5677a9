"""Stop strings in streamed text, found even when they are split across chunks.

`StopMatcher` is fed text in arbitrary pieces. It emits text as early as it can, but
holds back the longest tail that could still grow into a stop string. The first stop
string to be completed ends the stream; the result does not depend on how the text
was cut into pieces.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StopResult:
    text: str  # text safe to emit now
    stop: str | None  # the stop string that matched (generation must end), else None


class StopMatcher:
    """Finds the first stop string in a stream of text pieces."""

    def __init__(self, stops: Sequence[str], *, include_stop: bool = False) -> None:
        if isinstance(stops, str):
            raise TypeError("stops must be a sequence of strings, not a string")
        if any(not stop for stop in stops):
            raise ValueError("stop strings must not be empty")
        # Longest first, so that among stops ending at the same place the longest wins.
        self._stops = sorted(set(stops), key=len, reverse=True)
        self._include_stop = include_stop
        self._max_held = max((len(stop) for stop in self._stops), default=1) - 1
        # Every proper prefix of a stop string: the tails worth holding back.
        self._prefixes = {stop[:n] for stop in self._stops for n in range(1, len(stop))}
        self._held = ""
        self._stopped = False

    def push(self, text: str) -> StopResult:
        """Feed the next piece; return what can be emitted, and the stop if one matched."""
        if self._stopped:
            raise RuntimeError("StopMatcher.push called after a stop string matched")
        if not self._stops:
            return StopResult(text, None)
        buf = self._held + text
        match = self._first_match(buf)
        if match is not None:
            start, stop = match
            self._stopped = True
            self._held = ""
            end = start + len(stop) if self._include_stop else start
            return StopResult(buf[:end], stop)
        keep = self._held_length(buf)
        self._held = buf[len(buf) - keep :]
        return StopResult(buf[: len(buf) - keep], None)

    def flush(self) -> str:
        """End of stream with no match: return the held-back tail."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, buf: str) -> tuple[int, str] | None:
        """The stop completed first in `buf` (earliest end; then the longest)."""
        best: tuple[int, str] | None = None
        best_end = len(buf) + 1
        for stop in self._stops:
            start = buf.find(stop, 0, min(best_end - 1, len(buf)))
            if start >= 0 and start + len(stop) < best_end:
                best, best_end = (start, stop), start + len(stop)
        return best

    def _held_length(self, buf: str) -> int:
        """Length of the longest tail of `buf` that is a proper prefix of a stop."""
        for n in range(min(self._max_held, len(buf)), 0, -1):
            if buf[len(buf) - n :] in self._prefixes:
                return n
        return 0
