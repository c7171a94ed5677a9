"""Failover as a policy over the kinds of worker failure.

A request's worker call fails with one `FailureKind` (see `control.workers.call`). The
policy says what the request does next: try another worker (before the first token the
client never notices; after it the new worker resumes from the tokens so far), end the
stream with TIME_LIMIT, or fail.

- LOST, EJECTED: another worker, as long as one remains: the worker is gone or hung, the
  request did nothing wrong.
- OVERLOADED: another worker; with none left the client hears RESOURCE_EXHAUSTED.
- ENGINE: another worker, `max_engine_retries` times per request, so that a request
  that breaks engines cannot take every replica down in turn.
- DEADLINE: the stream ends with TIME_LIMIT.
- REJECTED, SLOW_READER: the request ends; they would fail the same way anywhere.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from control.workers.call import FailureKind, WorkerCallFailed


class Next(enum.Enum):
    RETRY = "retry"
    TIME_LIMIT = "time_limit"
    FAIL = "fail"


_ALWAYS_RETRY = frozenset({FailureKind.LOST, FailureKind.EJECTED, FailureKind.OVERLOADED})


@dataclass(frozen=True, slots=True)
class FailoverPolicy:
    max_engine_retries: int = 1

    def next_step(self, failure: WorkerCallFailed, engine_errors_so_far: int) -> Next:
        kind = failure.kind
        if kind in _ALWAYS_RETRY:
            return Next.RETRY
        if kind is FailureKind.ENGINE:
            return Next.RETRY if engine_errors_so_far < self.max_engine_retries else Next.FAIL
        if kind is FailureKind.DEADLINE:
            return Next.TIME_LIMIT
        return Next.FAIL


DEFAULT_POLICY = FailoverPolicy()
