"""The worker's own view of its load: requests in flight and generated tokens per second.

Engine stats arrive only when the engine steps, so they go stale when it goes idle
(after a cancellation, say). The servicer's own bookkeeping bounds them.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class InFlight:
    """One Generate call between validation and its last message."""

    request_id: str
    aborted: bool = False  # by the Abort RPC: the stream ends with a CANCELLED final
    finished: bool = False  # the engine reported the request finished
    prompt_tokens: int = 0
    completion_tokens: int = 0  # streamed so far
    adapter: str = ""  # the LoRA adapter it uses
    # Stops a request whose engine requests have ids of their own (a beam search's).
    on_abort: Callable[[], object] | None = None


class TokenRate:
    """Generated tokens per second over a sliding window."""

    def __init__(self, window_s: float = 2.0, bucket_s: float = 0.1) -> None:
        if window_s <= 0 or bucket_s <= 0:
            raise ValueError("window_s and bucket_s must be positive")
        self._window_s = window_s
        self._bucket_s = bucket_s
        # (bucket index, tokens) in time order; one entry per bucket, not per token.
        self._buckets: deque[tuple[int, int]] = deque()

    def add(self, tokens: int, now: float | None = None) -> None:
        if tokens <= 0:
            return
        now = time.monotonic() if now is None else now
        index = int(now // self._bucket_s)
        if self._buckets and self._buckets[-1][0] == index:
            self._buckets[-1] = (index, self._buckets[-1][1] + tokens)
        else:
            self._buckets.append((index, tokens))
            self._expire(now)

    def rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        self._expire(now)
        return sum(tokens for _, tokens in self._buckets) / self._window_s

    def _expire(self, now: float) -> None:
        """Drop buckets that lie entirely before the window."""
        horizon = now - self._window_s
        while self._buckets and (self._buckets[0][0] + 1) * self._bucket_s <= horizon:
            self._buckets.popleft()
