"""A circuit breaker per worker.

Closed: traffic flows; `failure_threshold` consecutive failures (requests or canaries)
open it. Open: no traffic for `open_s`, doubling on each failed probe up to `max_open_s`.
Half-open: still no traffic; the next canary is the probe: success closes the circuit,
failure opens it again.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable


class State(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    def __init__(
        self,
        failure_threshold: int = 3,
        open_s: float = 2.0,
        max_open_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.failure_threshold = failure_threshold
        self.base_open_s = open_s
        self.max_open_s = max_open_s
        self._clock = clock
        self._state = State.CLOSED
        self._failures = 0
        self._open_s = open_s
        self._open_until = 0.0

    @property
    def state(self) -> State:
        if self._state is State.OPEN and self._clock() >= self._open_until:
            self._state = State.HALF_OPEN
        return self._state

    def peek(self) -> State:
        """The state, without moving OPEN to HALF_OPEN (for readers on other threads)."""
        if self._state is State.OPEN and self._clock() >= self._open_until:
            return State.HALF_OPEN
        return self._state

    def allows_traffic(self) -> bool:
        return self.state is State.CLOSED

    def record_success(self) -> None:
        self._failures = 0
        self._state = State.CLOSED
        self._open_s = self.base_open_s

    def record_failure(self) -> None:
        state = self.state
        if state is State.HALF_OPEN:
            self._open_s = min(self._open_s * 2, self.max_open_s)
            self._open(self._open_s)
            return
        self._failures += 1
        if state is State.CLOSED and self._failures >= self.failure_threshold:
            self._open(self._open_s)

    def _open(self, seconds: float) -> None:
        self._state = State.OPEN
        self._open_until = self._clock() + seconds
