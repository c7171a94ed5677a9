"""The circuit breaker and the routing policies, on their own."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest

from control.routing import RouteRequest, load_score, make_policy
from control.routing.prefix_affinity import PrefixAffinity
from control.workers.circuit import CircuitBreaker, State


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_circuit_opens_after_consecutive_failures_and_probes() -> None:
    clock = Clock()
    cb = CircuitBreaker(failure_threshold=3, open_s=2.0, max_open_s=5.0, clock=clock)
    cb.record_failure()
    cb.record_failure()
    cb.record_success()  # resets the count
    cb.record_failure()
    cb.record_failure()
    assert cb.allows_traffic()
    cb.record_failure()
    assert cb.state is State.OPEN and not cb.allows_traffic()
    clock.now = 2.0
    assert cb.state is State.HALF_OPEN and not cb.allows_traffic()
    cb.record_failure()  # the probe failed: open again, twice as long
    clock.now = 5.9
    assert cb.state is State.OPEN
    clock.now = 6.0
    assert cb.state is State.HALF_OPEN
    cb.record_success()
    assert cb.state is State.CLOSED and cb.allows_traffic()


@dataclass
class W:
    address: str
    running: int = 0
    waiting: int = 0
    in_flight: int = 0
    in_flight_tokens: int = 0
    in_flight_at_report: int = 0
    prefill_tokens: int = 0


REQ = RouteRequest(prompt_ids=list(range(100)), max_tokens=10, kv_block_size=16)


def test_round_robin_cycles() -> None:
    ws = [W("a"), W("b"), W("c")]
    p = make_policy("round_robin")
    assert [p.choose(ws, REQ).address for _ in range(6)] == list("abcabc")


def test_least_load_uses_reports_and_own_counts() -> None:
    ws = [W("a", running=3), W("b", in_flight=2), W("c", running=1, in_flight_tokens=4096)]
    assert load_score(ws[2]) == pytest.approx(1 + 4)
    assert make_policy("least_load").choose(ws, REQ).address == "b"


def test_least_load_counts_own_requests_since_the_report_in_full() -> None:
    """Several router processes share workers: each sees the others' requests only in
    the workers' reports, but its own at once. Four new requests after a report of 10
    and 12 running go 2 and 2 (or 3 and 1), not all four to the one that looked lighter;
    requests that ended since the report come off the reported count."""
    ws = [W("a", running=10), W("b", running=12)]
    p = make_policy("least_load")
    picks = []
    for _ in range(4):
        w = p.choose(ws, REQ)
        assert isinstance(w, W)
        w.in_flight += 1
        w.in_flight_tokens += 384
        picks.append(w.address)
    assert picks[:2] == ["a", "a"] and "b" in picks
    ended = W("c", running=12, in_flight=1, in_flight_at_report=5)  # 4 of its own ended
    assert load_score(ended) == pytest.approx(8)
    assert load_score(W("d", running=0, in_flight=3, in_flight_at_report=3)) == 3  # own floor


def test_power_of_two_prefers_the_lighter_of_two() -> None:
    ws = [W("idle"), W("busy", running=50), W("busier", running=90)]
    counts = Counter(make_policy("power_of_two").choose(ws, REQ).address for _ in range(300))
    assert counts["busier"] == 0  # it loses every pair it is in
    assert counts["idle"] > counts["busy"] > 0


def test_prefix_affinity_is_sticky_and_spreads_prefixes() -> None:
    ws = [W(f"w{i}") for i in range(8)]
    p = PrefixAffinity(blocks=2)
    shared = list(range(32))
    picks = {p.choose(ws, RouteRequest([*shared, 1000 + i], 4, 16)).address for i in range(20)}
    assert len(picks) == 1  # same first two blocks, same worker
    spread = Counter(p.choose(ws, RouteRequest([i] * 40, 4, 16)).address for i in range(400))
    assert len(spread) == 8 and min(spread.values()) > 20


def test_prefix_affinity_falls_back_when_the_preferred_worker_is_busy() -> None:
    ws = [W(f"w{i}") for i in range(4)]
    p = PrefixAffinity(blocks=2, slack=2, factor=0.5)
    preferred = p.choose(ws, REQ)
    preferred.running = 10
    assert p.choose(ws, REQ).address != preferred.address
    preferred.running = 2  # within the slack: affinity wins
    assert p.choose(ws, REQ).address == preferred.address
    short = RouteRequest(prompt_ids=[1, 2, 3], max_tokens=4, kv_block_size=16)
    assert p.choose(ws, short).address != preferred.address  # no full block: least load


def test_unknown_policy() -> None:
    with pytest.raises(ValueError, match="unknown routing policy 'fastest'"):
        make_policy("fastest")


def test_peek_reads_the_breaker_without_moving_it() -> None:
    now = [0.0]
    breaker = CircuitBreaker(failure_threshold=1, open_s=1.0, clock=lambda: now[0])
    breaker.record_failure()
    now[0] = 2.0
    assert breaker.peek() is State.HALF_OPEN
    assert breaker._state is State.OPEN  # not moved by the look
    assert breaker.state is State.HALF_OPEN
