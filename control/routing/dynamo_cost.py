"""A reimplementation of the cost formula NVIDIA Dynamo's KV router publishes, as a
baseline for `kv_aware` (bench/fleet/sim.py, bench/fleet/kv_routing.py). Not Dynamo's code:
its documented formula over what this control plane knows.

Dynamo's router documents, per worker w (in KV blocks):

    cost(w) = overlap_score_weight * prefill_blocks(w) + decode_blocks(w)

- prefill_blocks: the prompt blocks w would still compute (those its cache does not hold,
  from the engines' KV events), plus the prefill already queued on w. Dynamo counts the
  latter per request until the first token; here it is w's waiting requests times the
  mean prompt length in blocks routed so far. (`Candidate.prefill_tokens`, which
  kv_aware reads, would be closer to Dynamo's count; the baseline's figures in
  docs/results/kv-routing.md were measured with this estimate.)
- decode_blocks: the blocks of w's active requests plus the new request's. Here: this
  process's in-flight tokens on w over the block size, plus the prompt's blocks.

Defaults as Dynamo documents them: overlap_score_weight 1, temperature 0 (the cheapest
worker; ties at random). Above 0, a softmax over the costs normalised to [0, 1]. It
follows the engines' events only (Dynamo's default `--kv-events`), learning nothing from
the prompts it routes.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from control.routing.base import Candidate, RouteRequest
from control.routing.kv_index import KvIndex, prompt_keys


class DynamoCost:
    name = "dynamo_cost"
    follows_events = True

    def __init__(
        self,
        overlap_score_weight: float = 1.0,
        temperature: float = 0.0,
        index: KvIndex | None = None,
        seed: int | None = None,
    ) -> None:
        if overlap_score_weight < 0 or temperature < 0:
            raise ValueError("dynamo_cost's weight and temperature must be >= 0")
        self.overlap_score_weight = overlap_score_weight
        self.temperature = temperature
        self.index = index if index is not None else KvIndex()
        self._rng = random.Random(seed)
        self._routed = 0
        self._routed_blocks = 0

    def choose(self, candidates: Sequence[Candidate], request: RouteRequest) -> Candidate:
        size = max(request.kv_block_size, 1)
        blocks = math.ceil(len(request.prompt_ids) / size)
        keys = prompt_keys(request.prompt_ids, size, request.adapter)
        held = self.index.overlap(keys, (c.address for c in candidates))
        self._routed += 1
        self._routed_blocks += blocks
        mean_blocks = self._routed_blocks / self._routed
        costs = []
        for c in candidates:
            prefill = (blocks - held[c.address]) + c.waiting * mean_blocks
            decode = c.in_flight_tokens / size + blocks
            costs.append(self.overlap_score_weight * prefill + decode)
        if self.temperature == 0:
            low = min(costs)
            best = [i for i, cost in enumerate(costs) if cost == low]
            return candidates[self._rng.choice(best)]
        low, high = min(costs), max(costs)
        spread = (high - low) or 1.0
        weights = [math.exp(-((cost - low) / spread) / self.temperature) for cost in costs]
        return candidates[self._rng.choices(range(len(candidates)), weights=weights)[0]]
