"""The one deadline margin: the part of a time budget kept back so that a TIME_LIMIT
answer (its final and the call's status) reaches the caller before the caller's own
deadline fires, even on a busy machine.

A tenth of the budget, at least 20 ms and at most 100 ms, and never more than a quarter
of it: 50 ms keeps 37.5 ms to work, 0.5 s keeps 0.45 s, 5 s keeps 4.9 s. A 20-minute soak
with a fixed 20 ms margin saw about 1% of its streams get their final and then the
client's own DEADLINE_EXCEEDED instead of OK (docs/results/soak.md).
"""

from __future__ import annotations

DEADLINE_MARGIN_S = 0.02
DEADLINE_MARGIN_MAX_S = 0.1


def margin(remaining_s: float) -> float:
    left = max(remaining_s, 0.0)
    return min(max(DEADLINE_MARGIN_S, left / 10), DEADLINE_MARGIN_MAX_S, left / 4)


def budget(remaining_s: float) -> float:
    """The time to spend of `remaining_s`: all of it but the margin."""
    return remaining_s - margin(remaining_s)
