"""bench/fleet/kv_routing's own bookkeeping (its runs on real workers are measurements, not
tests): the weights a variant names, and what a run's tally reports."""

from __future__ import annotations

import argparse

import pytest

from bench.fleet.kv_routing import Tally, variant


def test_a_variant_is_a_label_and_kv_aware_weights() -> None:
    assert variant('e0={"eviction_weight": 0}') == ("e0", {"eviction_weight": 0})
    for bad, says in (
        ("e0", "LABEL=JSON"),
        ('={"a": 1}', "LABEL=JSON"),
        ("e0={", "not JSON"),
        ("e0=[1]", "JSON object"),
    ):
        with pytest.raises(argparse.ArgumentTypeError, match=says):
            variant(bad)


def test_a_tally_reports_the_engines_hit_rate_and_each_workers_share() -> None:
    t = Tally(4)
    t.trace[0] = ("w1", 256, 128, 10.0)
    t.trace[1] = ("w2", 256, 0, 20.0)
    t.trace[3] = ("w1", 512, 384, 30.0)  # request 2 never finished
    t.prompt_tokens, t.cached, t.tokens, t.sending_s = 1024, 512, 30, 3.0
    t.ttft += [10.0, 20.0, 30.0]
    t.control_cpu_s, t.workers_cpu_s = 1.234, 56.789
    r = t.result("kv_aware", seed=1, routers=4, restarts=1)
    assert (r.control_cpu_s, r.workers_cpu_s) == (1.23, 56.79)
    assert (r.policy, r.seed, r.routers, r.restarts) == ("kv_aware", 1, 4, 1)
    assert r.engine_hit_rate == 0.5
    assert r.completed == 3 and r.requests == 4
    assert r.output_tok_s == 10.0
    assert r.request_share == {"w1": 0.667, "w2": 0.333}
    assert r.trace[2] == ("", 0, 0, None)  # nothing recorded for it
