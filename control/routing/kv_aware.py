"""KV-aware routing: the worker where the prompt costs least, counting both the prompt
blocks it would have to compute and the work it already has.

For a prompt of B blocks (the last one partial or not) and a candidate w that holds its
first o_w blocks (`kv_index.KvIndex.overlap`), in tokens:

    cost(w) = overlap_weight * (B - o_w) * block_size                 (its own prefill)
            + eviction_weight * (F - o_w) * block_size * h_w / h_max     (what it evicts)
            + prefill_weight * prefill_tokens(w)                         (prefill queued ahead)
            + load_weight * load_score(w) * TOKENS_PER_REQUEST_WEIGHT      (work already there)

F counts the prompt's full blocks (those a cache keeps). `h_w` is how many blocks the
index says w holds, `h_max` the most any candidate holds: the blocks a prompt adds to a
full cache push others' cached prefixes out, so they cost more there than in a cache with
room (SMG's "smallest tree" rule, as a cost).
`prefill_tokens` are the prompt tokens of this process's requests on w that have had no
token back yet: the prefill a new request waits behind for its first token. `load_score`
is least load's (running and waiting requests, with this process's own since the last
report, plus their tokens), so with nothing cached anywhere and nothing queued this is
least load. With `temperature` 0 the cheapest worker takes the request (ties go
to the one first in turn); above 0 a worker is drawn with probability proportional to
exp(-cost / (temperature * block_size * B)), which spreads requests among nearly equal
workers.

The index learns from the prompts it routes (the chosen worker is taken to hold them);
workers whose engines report KV-cache events feed the same index exactly
(`KvIndex.stored` / `removed`). A LoRA adapter's blocks are keyed apart from the base
model's (the adapter's name salts the first block, as vLLM's events name it).
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Sequence

from control.routing.base import TOKENS_PER_REQUEST_WEIGHT, Candidate, RouteRequest, load_score
from control.routing.kv_index import KvIndex, prompt_keys

# A running request weighs about 10 tokens of prefill (1024 x 0.01), a queued prompt token
# one: on the fleet simulation (bench/fleet_sim.py, 64 workers, tenants' conversations)
# these gave the lowest TTFT p99; a request as 1024 tokens (1.0) kept too little of the
# cache, 0.003 too little of the balance (docs/kv-routing.md has the sweeps).
LOAD_WEIGHT = 0.01
PREFILL_WEIGHT = 1.0
# New blocks in the fullest cache cost three times what they cost in an empty one: on the
# fleet simulation this lowered TTFT p99 at every load from 400 to 1,000 requests/s.
EVICTION_WEIGHT = 2.0


class KvAware:
    name = "kv_aware"
    follows_events = True

    def __init__(
        self,
        overlap_weight: float = 1.0,
        load_weight: float = LOAD_WEIGHT,
        temperature: float = 0.0,
        prefill_weight: float = PREFILL_WEIGHT,
        eviction_weight: float = EVICTION_WEIGHT,
        index: KvIndex | None = None,
        learn: bool = True,
        rng: random.Random | None = None,
    ) -> None:
        if min(overlap_weight, load_weight, temperature, prefill_weight, eviction_weight) < 0:
            raise ValueError("kv_aware weights and temperature must be >= 0")
        self.eviction_weight = eviction_weight
        self.overlap_weight = overlap_weight
        self.prefill_weight = prefill_weight
        self.load_weight = load_weight
        self.temperature = temperature
        self.index = index if index is not None else KvIndex()
        self.learn = learn
        self._rng = rng or random.Random()
        self._tie = itertools.count()

    def choose(self, candidates: Sequence[Candidate], request: RouteRequest) -> Candidate:
        size = max(request.kv_block_size, 1)
        blocks = math.ceil(len(request.prompt_ids) / size)
        keys = prompt_keys(request.prompt_ids, size, request.adapter)  # once per request
        held = self.index.overlap(keys, (c.address for c in candidates))
        room = [self.index.held(c.address) for c in candidates]
        full = max(room) or 1
        # Each candidate's cost, in tokens, in the candidates' order.
        costs = [
            self.overlap_weight * (blocks - held[c.address]) * size
            + self.eviction_weight * (len(keys) - held[c.address]) * size * room[i] / full
            + self.prefill_weight * c.prefill_tokens
            + self.load_weight * load_score(c) * TOKENS_PER_REQUEST_WEIGHT
            for i, c in enumerate(candidates)
        ]
        chosen: Candidate
        if self.temperature == 0:
            start = next(self._tie) % len(candidates)
            order = [*range(start, len(candidates)), *range(start)]
            chosen = candidates[min(order, key=lambda i: costs[i])]
        else:
            scale = self.temperature * size * max(1, blocks)
            low = min(costs)
            weights = [math.exp(-(c - low) / scale) for c in costs]
            chosen = candidates[self._rng.choices(range(len(candidates)), weights=weights)[0]]
        if self.learn:
            self.index.learn(chosen.address, keys)
        return chosen
