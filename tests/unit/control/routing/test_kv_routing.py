"""The KV-cache index (`control.routing.kv_index`) and the `kv_aware` policy, on their own:
the index against a plain model of what each worker holds, under generated sequences of
engine events; the policy's choice between cached blocks and load."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from control.routing import RouteRequest, make_policy
from control.routing.kv_aware import KvAware
from control.routing.kv_index import KvIndex, block_key, prompt_keys
from tests.unit.control.routing.test_circuit_and_routing import W

BLOCK = 4


def test_keys_chain_the_whole_prefix() -> None:
    a = prompt_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], BLOCK)
    b = prompt_keys([1, 2, 3, 4, 5, 6, 7], BLOCK)
    c = prompt_keys([9, 2, 3, 4, 5, 6, 7, 8], BLOCK)
    assert len(a) == 2 and len(b) == 1  # full blocks only
    assert a[0] == b[0] and a[1] != c[1]  # the same second block after another first one
    assert prompt_keys([1, 2, 3, 4], BLOCK, salt="tenant-a") != prompt_keys([1, 2, 3, 4], BLOCK)
    assert a[1] == block_key(block_key(0, [1, 2, 3, 4]), [5, 6, 7, 8])


def test_events_from_an_engine_feed_the_index_and_removals_name_engine_hashes() -> None:
    index = KvIndex()
    tokens = list(range(12))
    # The engine stores the first two blocks, then a third after them, by its own hashes.
    assert index.stored("w1", [101, 102], None, tokens[:8], BLOCK)
    assert index.stored("w1", [103], 102, tokens[8:], BLOCK)
    keys = prompt_keys([*tokens, 99], BLOCK)
    assert index.overlap(keys, ["w1", "w2"]) == {"w1": 3, "w2": 0}
    index.removed("w1", [102])  # the middle block evicted: only the first still counts
    assert index.overlap(keys, ["w1"]) == {"w1": 1}
    # A stored block whose parent is unknown here (a missed event) is refused.
    assert not index.stored("w2", [201], 999, tokens[:4], BLOCK)
    assert not index.stored("w2", [201], None, tokens[:3], BLOCK)  # not a whole block
    index.cleared("w1")
    assert index.overlap(keys, ["w1"]) == {"w1": 0} and len(index) == 0


def test_the_index_is_bounded_oldest_first() -> None:
    index = KvIndex(max_blocks=3)
    keys = prompt_keys(list(range(20)), BLOCK)  # 5 blocks
    index.learn("w1", keys)
    assert len(index) == 3
    assert index.overlap(keys, ["w1"]) == {"w1": 0}  # the first two went first
    assert [index.holds("w1", k) for k in keys] == [False, False, True, True, True]
    with pytest.raises(ValueError):
        KvIndex(max_blocks=0)


@st.composite
def _events(draw: st.DrawFn) -> list[tuple[str, str, int, int]]:
    """(kind, worker, chain, length): store a chain's first blocks, remove a block of it,
    or clear a worker. Chains are fixed token sequences shared by all workers."""
    kinds = st.sampled_from(["store", "store", "store", "remove", "clear"])
    event = st.tuples(kinds, st.sampled_from(["w1", "w2", "w3"]), st.integers(0, 3),
                      st.integers(1, 5))  # fmt: skip
    return draw(st.lists(event, max_size=40))


CHAINS = [[c * 100 + i for i in range(5 * BLOCK)] for c in range(4)]


def _engine_hash(worker: str, chain: int, block: int) -> int:
    """What an engine might call a block: its own numbering, different per worker."""
    return hash((worker, chain, block)) & 0xFFFFFFFF


@settings(max_examples=200, deadline=None)
@given(_events())
def test_the_index_agrees_with_a_plain_model_of_each_workers_blocks(
    events: list[tuple[str, str, int, int]],
) -> None:
    index = KvIndex()
    held: dict[str, set[tuple[int, int]]] = {"w1": set(), "w2": set(), "w3": set()}
    for kind, worker, chain, length in events:
        if kind == "store":  # blocks 0..length-1, each after its parent, as an engine does
            for b in range(length):
                if (chain, b) in held[worker]:
                    continue
                parent = None if b == 0 else _engine_hash(worker, chain, b - 1)
                if b > 0 and (chain, b - 1) not in held[worker]:
                    break  # an engine caches a block only after its prefix
                tokens = CHAINS[chain][b * BLOCK : (b + 1) * BLOCK]
                assert index.stored(worker, [_engine_hash(worker, chain, b)], parent, tokens, BLOCK)
                held[worker].add((chain, b))
        elif kind == "remove":
            index.removed(worker, [_engine_hash(worker, chain, length - 1)])
            held[worker].discard((chain, length - 1))
        else:
            index.cleared(worker)
            held[worker].clear()
    for chain in range(4):
        keys = prompt_keys(CHAINS[chain], BLOCK)
        got = index.overlap(keys, held)
        for worker, blocks in held.items():
            run = 0
            while (chain, run) in blocks:
                run += 1
            assert got[worker] == run, (worker, chain)


def test_kv_aware_prefers_the_worker_holding_the_prompt_until_its_load_outweighs_it() -> None:
    ws = [W(f"w{i}") for i in range(4)]
    policy = KvAware()
    system = list(range(64))  # a shared system prompt: 4 blocks of 16
    first = policy.choose(ws, RouteRequest([*system, 1000], 8, 16))
    # It learned the prompt: the next request with the same system prompt goes there too,
    # though another worker is as idle.
    again = [policy.choose(ws, RouteRequest([*system, 2000 + i], 8, 16)) for i in range(5)]
    assert {w.address for w in again} == {first.address}
    # Six running requests (about 10 tokens of work each) weigh less than 64 cached
    # tokens ...
    first.running = 6
    assert policy.choose(ws, RouteRequest([*system, 3000], 8, 16)).address == first.address
    # Fewer than 64 prompt tokens queued there for prefill do not (a request would wait
    # behind them) ...
    first.running, first.prefill_tokens = 0, 60
    assert policy.choose(ws, RouteRequest([*system, 5000], 8, 16)).address == first.address
    # ... 65 do, as do seven running requests.
    first.prefill_tokens = 65
    assert policy.choose(ws, RouteRequest([*system, 6000], 8, 16)).address != first.address
    first.running, first.prefill_tokens = 7, 0
    assert policy.choose(ws, RouteRequest([*system, 4000], 8, 16)).address != first.address


def test_kv_aware_with_nothing_cached_is_least_load_then_spreads_new_blocks() -> None:
    ws = [W("a", running=3), W("b", running=1), W("c", running=2)]
    plain = KvAware(learn=False, eviction_weight=0)
    picks = Counter(plain.choose(ws, RouteRequest([i] * 40, 4, 16)).address for i in range(30))
    assert picks == {"b": 30}
    # With the eviction weight, 32 new tokens a request pile up on b until they weigh
    # more there than a running request or two: the others take some, least loaded most.
    policy = KvAware(learn=False)
    picks = Counter(policy.choose(ws, RouteRequest([i] * 40, 4, 16)).address for i in range(30))
    assert picks["b"] > picks["c"] > picks["a"] > 0
    assert make_policy("kv_aware").name == "kv_aware"


def test_kv_aware_temperature_spreads_among_near_equals() -> None:
    ws = [W(f"w{i}") for i in range(3)]
    policy = KvAware(temperature=1.0, learn=False, rng=random.Random(7))
    picks = Counter(policy.choose(ws, RouteRequest(list(range(64)), 4, 16)).address
                    for _ in range(300))  # fmt: skip
    assert set(picks) == {"w0", "w1", "w2"} and min(picks.values()) > 60
    with pytest.raises(ValueError):
        KvAware(temperature=-1)


def test_kv_aware_puts_new_blocks_where_they_evict_least() -> None:
    busy, quiet = W("busy"), W("quiet", running=3)
    for weight, expected in ((2.0, "quiet"), (0.0, "busy")):
        policy = KvAware(learn=False, eviction_weight=weight)
        # Five prompts of new blocks went to "busy" (the only candidate then): in a full
        # cache each pushed an older block out.
        for i in range(5):
            policy.choose([busy], RouteRequest([5000 + i] * 64, 8, 16))
        # A new prompt's 4 blocks would evict more of what "busy" holds: that outweighs
        # three running requests (about 31 tokens) on "quiet". Without the weight, load
        # decides.
        new = RouteRequest(list(range(64)), 8, 16)
        assert policy.choose([busy, quiet], new).address == expected, weight
    # A prompt "busy" holds stays there: only new blocks evict.
    policy.index.learn("busy", prompt_keys([7] * 64, 16))
    policy.eviction_weight = 2.0
    assert policy.choose([busy, quiet], RouteRequest([7] * 64 + [1, 2], 8, 16)).address == "busy"


def test_kv_aware_forgets_the_pressure_on_a_worker_gone_long_enough() -> None:
    gone, a, b = W("gone"), W("a"), W("b")
    policy = KvAware(learn=False)
    policy.choose([gone], RouteRequest(list(range(64)), 8, 16))  # 4 new blocks there
    assert "gone" in policy._pressure
    # While it is away, its pressure decays (halving every 16 requests per candidate)
    # but is kept: it may come back.
    for i in range(63):
        policy.choose([a, b], RouteRequest([1000 + i] * 64, 8, 16))
    assert "gone" in policy._pressure
    # Once decayed to nothing, it is forgotten; the workers still routed to are not.
    for i in range(64 * 8):
        policy.choose([a, b], RouteRequest([2000 + i] * 64, 8, 16))
    assert set(policy._pressure) == {"a", "b"}
