"""The policy interface and what a policy may look at."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class Candidate(Protocol):
    """A worker as a policy sees it."""

    @property
    def address(self) -> str: ...
    @property
    def running(self) -> int: ...  # as the worker last reported
    @property
    def waiting(self) -> int: ...
    @property
    def in_flight(self) -> int: ...  # requests this control plane has on it now
    @property
    def in_flight_tokens(self) -> int: ...  # their prompt plus remaining output tokens


@dataclass(frozen=True, slots=True)
class RouteRequest:
    prompt_ids: Sequence[int]
    max_tokens: int
    kv_block_size: int = 16


class Policy(Protocol):
    name: str

    def choose(self, candidates: Sequence[Candidate], request: RouteRequest) -> Candidate: ...


# How many in-flight tokens weigh as much as one running request.
TOKENS_PER_REQUEST_WEIGHT = 1024


def load_score(c: Candidate) -> float:
    """Lower is less loaded. The worker's own report lags by up to one interval; the
    control plane's in-flight counts are exact for its own requests, so take the larger
    view of requests and add the token weight."""
    requests = max(c.running + c.waiting, c.in_flight)
    return requests + c.in_flight_tokens / TOKENS_PER_REQUEST_WEIGHT
