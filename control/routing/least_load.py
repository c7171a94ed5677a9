"""Least load: the candidate with the lowest load score; ties go round-robin."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from control.routing.base import Candidate, RouteRequest, load_score


class LeastLoad:
    name = "least_load"

    def __init__(self) -> None:
        self._tie = itertools.count()

    def choose(self, candidates: Sequence[Candidate], request: RouteRequest) -> Candidate:
        start = next(self._tie) % len(candidates)
        rotated = [*candidates[start:], *candidates[:start]]
        return min(rotated, key=load_score)
