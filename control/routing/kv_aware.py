"""KV-aware routing: the worker where the prompt costs least, counting both the prompt
blocks it would have to compute and the work it already has.

For a prompt of B blocks (the last one partial or not) and a candidate w that holds its
first o_w blocks (`kv_index.KvIndex.overlap`), in tokens:

    cost(w) = overlap_weight * (B - o_w) * block_size                 (its own prefill)
            + eviction_weight * (F - o_w) * block_size * p_w / p_max     (what it evicts)
            + prefill_weight * prefill_tokens(w)                         (prefill queued ahead)
            + load_weight * load_score(w) * TOKENS_PER_REQUEST_WEIGHT      (work already there)

F counts the prompt's full blocks (those a cache keeps). `p_w` is the eviction pressure
on w: the new blocks sent there lately (each request's F - o_w, halving every
`PRESSURE_HALF_LIFE` requests per candidate), `p_max` the most on any candidate. A full
cache evicts a block for each new one: where new blocks pour in, what is cached lives
least long, so a prompt's new blocks cost more there (SMG's "smallest tree" rule, as a
cost that also holds once every cache is full).
`prefill_tokens` are the prompt tokens of this process's requests on w that have had no
token back yet: the prefill a new request waits behind for its first token. `load_score`
is least load's (running and waiting requests, with this process's own since the last
report, plus their tokens), so with nothing cached anywhere, nothing queued and no
eviction weight this is least load; with it, new blocks also spread away from where new
blocks went lately. With `temperature` 0 the cheapest worker takes the request (ties go
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
# one: on the fleet simulation (bench/fleet/sim.py, 64 workers, tenants' conversations)
# these gave the lowest TTFT p99; a request as 1024 tokens (1.0) kept too little of the
# cache, 0.003 too little of the balance (docs/kv-routing.md has the sweeps).
LOAD_WEIGHT = 0.01
PREFILL_WEIGHT = 1.0
# A new block where the pressure is highest costs three times what it costs where there is
# none: on the fleet simulation this lowered TTFT p99 at every load from 400 to 1,000
# requests/s (docs/kv-routing.md).
EVICTION_WEIGHT = 2.0
PRESSURE_HALF_LIFE = 16  # requests per candidate
PRUNE_EVERY = 64  # requests between looks for workers whose pressure is forgotten
PRESSURE_FORGOTTEN = 0.01  # blocks


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
        self._routed = 0  # requests routed, the pressure's clock
        self._pressure: dict[str, tuple[float, int]] = {}  # address -> (value, at)

    def pressure(self, address: str, candidates: int) -> float:
        """The new blocks sent to `address` lately, decayed to now."""
        value, at = self._pressure.get(address, (0.0, self._routed))
        half_life = PRESSURE_HALF_LIFE * max(candidates, 1)
        return float(value * 0.5 ** ((self._routed - at) / half_life))

    def choose(self, candidates: Sequence[Candidate], request: RouteRequest) -> Candidate:
        size = max(request.kv_block_size, 1)
        blocks = math.ceil(len(request.prompt_ids) / size)
        keys = prompt_keys(request.prompt_ids, size, request.adapter)  # once per request
        held = self.index.overlap(keys, (c.address for c in candidates))
        pressure = [self.pressure(c.address, len(candidates)) for c in candidates]
        top = max(pressure) or 1.0
        # Each candidate's cost, in tokens, in the candidates' order.
        costs = [
            self.overlap_weight * (blocks - held[c.address]) * size
            + self.eviction_weight * (len(keys) - held[c.address]) * size * pressure[i] / top
            + self.prefill_weight * c.prefill_tokens
            + self.load_weight * load_score(c) * TOKENS_PER_REQUEST_WEIGHT
            for i, c in enumerate(candidates)
        ]
        if self.temperature == 0:
            start = next(self._tie) % len(candidates)
            order = [*range(start, len(candidates)), *range(start)]
            pick = min(order, key=lambda i: costs[i])
        else:
            scale = self.temperature * size * max(1, blocks)
            low = min(costs)
            weights = [math.exp(-(c - low) / scale) for c in costs]
            pick = self._rng.choices(range(len(candidates)), weights=weights)[0]
        chosen: Candidate = candidates[pick]
        if self.learn:
            self.index.learn(chosen.address, keys)
        self._routed += 1
        self._pressure[chosen.address] = (
            pressure[pick] + len(keys) - held[chosen.address],
            self._routed,
        )
        if self._routed % PRUNE_EVERY == 0 and len(self._pressure) > len(candidates):
            self._prune(candidates)
        return chosen

    def _prune(self, candidates: Sequence[Candidate]) -> None:
        """Forget the pressure on workers no longer among the candidates once it has
        decayed to nothing (a worker that left, or was replaced): a worker away for a
        while (unhealthy, draining) keeps what it had."""
        here = {c.address for c in candidates}
        for address in [a for a in self._pressure if a not in here]:
            if self.pressure(address, len(candidates)) < PRESSURE_FORGOTTEN:
                del self._pressure[address]
