"""Routing policies: which of a model's eligible workers takes a request.

Health and circuit filtering happen before a policy runs; a policy only ranks the
candidates it is given (never empty). One policy per file, all behind `Policy`:

- `round_robin`: in turn.
- `least_load`: the lowest load score (worker-reported running and waiting requests plus
  the control plane's own in-flight requests and tokens).
- `power_of_two`: the less loaded of two random candidates.
- `prefix_affinity`: the worker chosen by a hash of the prompt's first KV-cache blocks, so
  repeated prefixes reach the worker that has them cached; least load when that worker is
  busy.
- `kv_aware`: the lowest cost of the prompt blocks a worker would still have to compute
  (from an index of the blocks each worker holds, `kv_index`) plus the work it already
  has (`kv_aware.py` has the formula). The default where workers report KV-cache events.

Two baselines for `kv_aware`, reimplemented from what their projects publish:
- `dynamo_cost`: NVIDIA Dynamo's KV router cost (prefill blocks times a weight, plus
  decode blocks), from the engines' events.
- `cache_aware`: SGLang's router and SMG's cache-aware policy (shortest queue when the
  load is out of balance, else the longest learned prefix above a match threshold, else
  the smallest tree).
"""

from __future__ import annotations

from collections.abc import Mapping

from control.routing.base import Candidate, IndexedPolicy, Policy, RouteRequest, load_score
from control.routing.cache_aware import CacheAware
from control.routing.dynamo_cost import DynamoCost
from control.routing.kv_aware import KvAware
from control.routing.least_load import LeastLoad
from control.routing.power_of_two import PowerOfTwo
from control.routing.prefix_affinity import PrefixAffinity
from control.routing.round_robin import RoundRobin

POLICIES: dict[str, type[Policy]] = {
    "round_robin": RoundRobin,
    "least_load": LeastLoad,
    "power_of_two": PowerOfTwo,
    "prefix_affinity": PrefixAffinity,
    "kv_aware": KvAware,
    "dynamo_cost": DynamoCost,
    "cache_aware": CacheAware,
}

# A model's policy when its config names none: kv_aware where its workers report
# KV-cache events, least load where they do not.
DEFAULT_POLICY = "least_load"
DEFAULT_POLICY_WITH_KV_EVENTS = "kv_aware"


def default_policy(kv_events: bool) -> str:
    return DEFAULT_POLICY_WITH_KV_EVENTS if kv_events else DEFAULT_POLICY


def make_policy(name: str, options: Mapping[str, float] | None = None) -> Policy:
    """The named policy, with its options (kv_aware's weights and temperature)."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(POLICIES)}") from None
    return cls(**options) if options else cls()


__all__ = [
    "POLICIES",
    "Candidate",
    "IndexedPolicy",
    "Policy",
    "RouteRequest",
    "default_policy",
    "load_score",
    "make_policy",
]
