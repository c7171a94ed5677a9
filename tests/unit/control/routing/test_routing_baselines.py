"""The baselines kv_aware is measured against (Dynamo's cost formula, SMG's cache-aware
thresholds), and the default policy: kv_aware where the workers report KV-cache events."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any, cast

import pytest

from control.config import ModelSpec, ServeConfig, parse_config
from control.config_yaml import config_to_yaml
from control.fleet.models import ModelEntry
from control.fleet.router_processes import router_config
from control.routing import POLICIES, IndexedPolicy, RouteRequest, make_policy
from control.routing.cache_aware import CacheAware
from control.routing.dynamo_cost import DynamoCost
from control.routing.kv_aware import KvAware
from control.routing.kv_index import prompt_keys
from control.workers.state import WorkerInfo
from tests.unit.control.routing.test_circuit_and_routing import W

SYSTEM = list(range(100, 164))  # 4 blocks of 16


def req(suffix: int, prompt: list[int] | None = None) -> RouteRequest:
    return RouteRequest([*(prompt or SYSTEM), suffix], 8, 16)


def test_dynamo_cost_prefers_the_worker_whose_engine_holds_the_prompt() -> None:
    ws = [W("a"), W("b"), W("c")]
    policy = DynamoCost(seed=0)
    # The engine on b reported storing the system prompt's blocks.
    policy.index.stored("b", [1, 2, 3, 4], None, SYSTEM, 16)
    assert policy.choose(ws, req(1)).address == "b"
    # It learns nothing from routing: with nothing reported, b's choice leaves no trace.
    other = list(range(500, 564))
    before = len(policy.index)
    policy.choose(ws, req(2, other))
    assert len(policy.index) == before
    # Decode blocks count against it: b's in-flight tokens of 4 blocks beat 4 cached ones
    # (4 prefill blocks saved, 4 + 1 decode blocks more), so the choice moves.
    ws[1].in_flight_tokens = 5 * 16
    assert policy.choose(ws, req(3)).address != "b"


def test_dynamo_cost_counts_queued_prefill_and_breaks_ties_at_random() -> None:
    ws = [W("a", waiting=2), W("b"), W("c")]
    policy = DynamoCost(seed=1)
    picks = Counter(policy.choose(ws, req(i)).address for i in range(60))
    assert "a" not in picks  # two queued prompts ahead of it
    assert set(picks) == {"b", "c"} and min(picks.values()) > 15
    with pytest.raises(ValueError):
        DynamoCost(overlap_score_weight=-1)


def test_dynamo_cost_temperature_samples_every_worker() -> None:
    ws = [W("a"), W("b", in_flight_tokens=160), W("c", in_flight_tokens=320)]
    policy = DynamoCost(temperature=1.0, seed=2)
    picks = Counter(policy.choose(ws, req(i)).address for i in range(300))
    assert picks["a"] > picks["b"] > picks["c"] > 0


def test_cache_aware_follows_the_longest_learned_prefix_above_its_threshold() -> None:
    ws = [W("a"), W("b"), W("c")]
    policy = CacheAware()
    first = policy.choose(ws, req(1))
    # The prompt was inserted into the chosen worker's tree: the system prompt is 64 of 65
    # tokens (above the 0.3 threshold), so every request with it follows.
    assert {policy.choose(ws, req(i)).address for i in range(2, 8)} == {first.address}
    # A prompt that matches little goes to the smallest tree instead (one that holds
    # nothing here), and is inserted there.
    fresh = policy.choose(ws, req(9, list(range(900, 964))))
    assert fresh.address != first.address and policy.index.held(fresh.address) == 4
    # A short match (one block of a 20-block prompt, 0.05) does not count either.
    long_prompt = [*SYSTEM[:16], *range(2000, 2300)]
    chosen = policy.choose(ws, RouteRequest(long_prompt, 8, 16))
    assert chosen.address not in {first.address, fresh.address}


def test_cache_aware_goes_by_load_when_it_is_out_of_balance() -> None:
    ws = [W("a"), W("b"), W("c")]
    policy = CacheAware()
    holder = policy.choose(ws, req(1))
    # 65 more in flight than the least loaded (over the absolute threshold of 64) and
    # more than 1.5 times it: the shortest queue takes it, cache or not.
    holder.in_flight = 66
    others = [w for w in ws if w is not holder]
    others[0].in_flight, others[1].in_flight = 1, 3
    assert policy.choose(ws, req(2)).address == others[0].address
    # Within the absolute threshold the cache still wins.
    holder.in_flight = 60
    assert policy.choose(ws, req(3)).address == holder.address
    with pytest.raises(ValueError):
        CacheAware(cache_threshold=2)


def test_the_baselines_are_policies_a_config_can_name() -> None:
    assert {"dynamo_cost", "cache_aware"} <= set(POLICIES)
    for name in ("dynamo_cost", "cache_aware"):
        spec = parse_config(
            {"models": [{"name": "m", "engine": "sim", "model": "builtin:tiny", "routing": name}]}
        ).models[0]
        policy = make_policy(spec.routing)
        assert isinstance(policy, IndexedPolicy) and policy.name == name
    assert DynamoCost.follows_events and KvAware.follows_events
    assert not CacheAware.follows_events  # SMG's tree is learned from routed prompts only


def info(kv_events: bool) -> WorkerInfo:
    return WorkerInfo("sim", "1", "tiny", 2048, 512, (2,), 16, kv_events=kv_events)


def entry(spec: ModelSpec, kv_events: bool) -> ModelEntry:
    return ModelEntry(spec=spec, tokenizer=cast(Any, None), info=info(kv_events))


def test_the_default_policy_is_kv_aware_where_workers_report_kv_events() -> None:
    raw = {"name": "m", "engine": "sim", "model": "builtin:tiny"}
    spec = parse_config({"models": [raw]}).models[0]
    assert spec.routing == ""  # not named: decided by the workers
    with_events = entry(spec, kv_events=True)
    assert with_events.policy.name == "kv_aware"
    assert with_events.kv_index is not None  # its workers' events feed it
    without = entry(spec, kv_events=False)
    assert without.policy.name == "least_load" and without.kv_index is None
    # Named, it is what it says, events or not; kv_aware's weights apply by default too.
    named = parse_config({"models": [{**raw, "routing": "round_robin"}]}).models[0]
    assert entry(named, kv_events=True).policy.name == "round_robin"
    weighted = parse_config({"models": [{**raw, "kv_aware": {"load_weight": 0.5}}]}).models[0]
    policy = entry(weighted, kv_events=True).policy
    assert isinstance(policy, KvAware) and policy.load_weight == 0.5
    # SMG's baseline learns its own tree: no events are followed for it.
    smg = parse_config({"models": [{**raw, "routing": "cache_aware"}]}).models[0]
    assert entry(smg, kv_events=True).kv_index is None


def test_router_processes_get_the_same_policy_and_weights() -> None:
    raw = {"name": "m", "engine": "sim", "model": "builtin:tiny", "kv_aware": {"load_weight": 0.5}}
    spec = parse_config({"models": [raw]}).models[0]
    shared = ServeConfig(listen="127.0.0.1:50070")

    def routed_as(spec: ModelSpec) -> ModelSpec:
        """The spec as a router reads it from the config the supervisor writes."""
        config = router_config(shared, [(spec, ["127.0.0.1:7001"])])
        return parse_config(config_to_yaml(config)).models[0]

    routed = routed_as(spec)
    assert routed.routing == "" and routed.kv_aware == (("load_weight", 0.5),)
    named = parse_config({"models": [{**raw, "routing": "kv_aware"}]}).models[0]
    assert routed_as(named).routing == "kv_aware"


def test_kv_aware_learning_and_the_baselines_share_one_key_scheme() -> None:
    # The same prompt keys whichever policy holds the index, so one event stream can feed
    # any of them.
    rng = random.Random(0)
    prompt = [rng.randrange(4, 500) for _ in range(80)]
    keys = prompt_keys(prompt, 16)
    for policy in (KvAware(), DynamoCost(), CacheAware()):
        policy.index.learn("w", keys)
        assert policy.index.overlap(keys, ["w"]) == {"w": 5}
