"""A reimplementation of the cache-aware policy of SGLang's router and SMG (the gateway
that grew from it), with its published thresholds, as a baseline for `kv_aware`
(bench/fleet/sim.py, bench/fleet/kv_routing.py). Not SMG's code: its documented algorithm over
this control plane's index.

Per request, with each worker's load its in-flight requests from this process:
1. Imbalanced when max load - min load > `balance_abs_threshold` (64) and
   max load > `balance_rel_threshold` (1.5) * min load: the least loaded worker takes it.
2. Otherwise the worker with the longest prompt prefix in the approximate tree takes it
   if the match covers more than `cache_threshold` (0.3) of the prompt; below that, the
   worker whose tree is smallest (the most room for a new prefix).
3. Either way the prompt is inserted into the chosen worker's tree.

The tree is learned from routed prompts only, never from the engines' events, as SMG
does for workers that report none; it is bounded by `max_blocks` (SMG's max tree size,
least recently used out first). The match is counted in whole KV blocks here, where SMG
counts tokens or characters.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from control.routing.base import Candidate, RouteRequest
from control.routing.kv_index import KvIndex, prompt_keys


class CacheAware:
    name = "cache_aware"
    follows_events = False

    def __init__(
        self,
        cache_threshold: float = 0.3,
        balance_abs_threshold: float = 64,
        balance_rel_threshold: float = 1.5,
        max_blocks: int = 1_000_000,
    ) -> None:
        if not 0 <= cache_threshold <= 1:
            raise ValueError("cache_threshold must be within [0, 1]")
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.index = KvIndex(max_blocks)
        self._tie = itertools.count()

    def choose(self, candidates: Sequence[Candidate], request: RouteRequest) -> Candidate:
        size = max(request.kv_block_size, 1)
        keys = prompt_keys(request.prompt_ids, size, request.adapter)
        start = next(self._tie) % len(candidates)
        ordered = [*candidates[start:], *candidates[:start]]  # ties in turn
        loads = [c.in_flight for c in ordered]
        low, high = min(loads), max(loads)
        if high - low > self.balance_abs_threshold and high > self.balance_rel_threshold * low:
            chosen = ordered[loads.index(low)]
        else:
            held = self.index.overlap(keys, (c.address for c in ordered))
            best = max(ordered, key=lambda c: held[c.address])
            rate = held[best.address] * size / max(len(request.prompt_ids), 1)
            if rate > self.cache_threshold:
                chosen = best
            else:
                chosen = min(ordered, key=lambda c: self.index.held(c.address))
        self.index.learn(chosen.address, keys)
        return chosen
