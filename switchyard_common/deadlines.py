"""The one deadline margin: the part of a time budget kept back so that a TIME_LIMIT
answer reaches the caller before the caller's own deadline fires."""

from __future__ import annotations

DEADLINE_MARGIN_S = 0.02


def budget(remaining_s: float) -> float:
    """The time to spend of `remaining_s`: all of it but the margin (at most a tenth of
    it, so that short budgets keep most of their time)."""
    return remaining_s - min(DEADLINE_MARGIN_S, max(remaining_s, 0.0) / 10)
