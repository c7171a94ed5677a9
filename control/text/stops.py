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


class _Automaton:
    """Knuth-Morris-Pratt over one stop string: `state` is the length of the longest
    suffix of the text so far that is a proper prefix of the stop, kept up to date one
    character at a time in amortised constant work."""

    __slots__ = ("fail", "state", "stop")

    def __init__(self, stop: str) -> None:
        self.stop = stop
        self.state = 0
        fail = [0] * len(stop)
        k = 0
        for i in range(1, len(stop)):
            while k and stop[i] != stop[k]:
                k = fail[k - 1]
            if stop[i] == stop[k]:
                k += 1
            fail[i] = k
        self.fail = fail

    def feed(self, ch: str) -> bool:
        """Advance by one character; True when the stop string is complete."""
        stop, s = self.stop, self.state
        while s and stop[s] != ch:
            s = self.fail[s - 1]
        if stop[s] == ch:
            s += 1
        if s == len(stop):
            self.state = self.fail[s - 1]
            return True
        self.state = s
        return False


class StopMatcher:
    """Finds the first stop string in a stream of text pieces.

    The work per piece is linear in the piece's length times the number of stop strings,
    whatever their length: each stop string's matcher state carries over between pieces,
    so no held-back text is scanned twice."""

    def __init__(self, stops: Sequence[str], *, include_stop: bool = False) -> None:
        if isinstance(stops, str):
            raise TypeError("stops must be a sequence of strings, not a string")
        if any(not stop for stop in stops):
            raise ValueError("stop strings must not be empty")
        # Longest first, so that among stops ending at the same place the longest wins.
        self._automata = [_Automaton(stop) for stop in sorted(set(stops), key=len, reverse=True)]
        self._include_stop = include_stop
        self._held = ""
        self._stopped = False

    def push(self, text: str) -> StopResult:
        """Feed the next piece; return what can be emitted, and the stop if one matched."""
        if self._stopped:
            raise RuntimeError("StopMatcher.push called after a stop string matched")
        automata = self._automata
        if not automata:
            return StopResult(text, None)
        held = self._held
        for j, ch in enumerate(text):
            matched: str | None = None
            for a in automata:
                if a.feed(ch) and matched is None:
                    matched = a.stop  # the longest of those ending here
            if matched is not None:
                self._stopped = True
                self._held = ""
                buf = held + text
                end = len(held) + j + 1
                start = end - len(matched)
                return StopResult(buf[: end if self._include_stop else start], matched)
        buf = held + text
        keep = max(a.state for a in automata)
        self._held = buf[len(buf) - keep :] if keep else ""
        return StopResult(buf[: len(buf) - keep], None)

    def flush(self) -> str:
        """End of stream with no match: return the held-back tail."""
        held, self._held = self._held, ""
        for a in self._automata:
            a.state = 0
        return held
