"""Round-robin: each eligible worker in turn."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from control.routing.base import Candidate, RouteRequest


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._next = itertools.count()

    def choose(self, candidates: Sequence[Candidate], request: RouteRequest) -> Candidate:
        return candidates[next(self._next) % len(candidates)]
