"""The fleet simulation, small: 8 simulated workers, a few hundred shared-prefix requests."""

from __future__ import annotations

import dataclasses

import pytest

from bench.fleet_sim import Result, WorkloadSpec, make_workload, simulate
from control.routing import POLICIES

WORKERS = 8
SPEC = WorkloadSpec(requests=400, rate=100.0, groups=32, seed=0)


@pytest.fixture(scope="module")
def results() -> dict[str, Result]:
    workload = make_workload(SPEC)
    return {name: simulate(name, workload, WORKERS, seed=0) for name in POLICIES}


def test_every_request_completes_under_every_policy(results: dict[str, Result]) -> None:
    expected_tokens = sum(make_workload(SPEC).max_tokens)
    for name, r in results.items():
        assert r.completed == r.requests == SPEC.requests, name
        assert r.output_tokens == expected_tokens, name
        assert 0 < r.ttft_p50_ms <= r.ttft_p99_ms, name


def test_prefix_affinity_hits_the_prefix_cache_more_than_round_robin(
    results: dict[str, Result],
) -> None:
    affinity = results["prefix_affinity"].prefix_hit_rate
    spread = results["round_robin"].prefix_hit_rate
    # Measured over seeds 0-7: affinity 0.68-0.74, round_robin 0.24-0.36.
    assert affinity >= spread + 0.2
    assert affinity >= 1.5 * spread


def test_a_fixed_seed_repeats_exactly(results: dict[str, Result]) -> None:
    workload = make_workload(SPEC)
    for name, first in results.items():
        again = simulate(name, workload, WORKERS, seed=0)
        assert dataclasses.replace(again, wall_s=0.0) == dataclasses.replace(first, wall_s=0.0)
