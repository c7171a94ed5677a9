"""Power of two choices: sample two candidates, take the less loaded one."""

from __future__ import annotations

import random
from collections.abc import Sequence

from control.routing.base import Candidate, RouteRequest, load_score


class PowerOfTwo:
    name = "power_of_two"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, candidates: Sequence[Candidate], request: RouteRequest) -> Candidate:
        if len(candidates) == 1:
            return candidates[0]
        a, b = self._rng.sample(range(len(candidates)), 2)
        return min(candidates[a], candidates[b], key=load_score)
