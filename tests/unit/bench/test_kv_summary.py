"""bench/kv_summary: the real-worker runs summed up over seeds, from kv_routing's JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.fleet.kv_summary import load, main, summarize


def _run(
    policy: str, seed: int, rate: float, routers: int = 1, restarts: int = 0
) -> dict[str, Any]:
    return {
        "policy": policy,
        "seed": seed,
        "routers": routers,
        "restarts": restarts,
        "engine_hit_rate": rate,
    }


def _file(path: Path, results: list[dict[str, Any]], ceilings: dict[int, float]) -> Path:
    path.write_text(
        json.dumps(
            {
                "reuse_ceiling": {
                    str(s): {"cached_prompt_tokens": int(c * 1000), "prompt_tokens": 1000}
                    for s, c in ceilings.items()
                },
                "results": results,
            }
        )
    )
    return path


def test_seeds_from_several_files_are_compared_seed_by_seed(tmp_path: Path) -> None:
    first = _file(
        tmp_path / "a.json",
        [
            _run("kv_aware", 0, 0.60),
            _run("cache_aware", 0, 0.62),
            _run("round_robin", 0, 0.40),
            _run("kv_aware", 1, 0.50),  # run again in the second file: that one counts
            _run("cache_aware", 1, 0.55),
            _run("kv_aware", 0, 0.58, routers=4),
            _run("cache_aware", 0, 0.45, routers=4),
        ],
        {0: 0.70, 1: 0.60},
    )
    second = _file(
        tmp_path / "b.json",
        [
            _run("kv_aware", 1, 0.57),
            _run("cache_aware", 1, 0.55),
            _run("kv_aware", 2, 0.65),
            _run("cache_aware", 2, 0.65),
        ],
        {2: 0.66},
    )
    runs, ceilings = load([first, second])
    assert ceilings == {0: 0.70, 1: 0.60, 2: 0.66}
    table = summarize(runs, ceilings)
    assert set(table) == {(1, 0), (4, 0)}
    rows = {r.policy: r for r in table[(1, 0)]}

    kv, ca, rr = rows["kv_aware"], rows["cache_aware"], rows["round_robin"]
    assert kv.seeds == 3 and kv.mean == pytest.approx((0.60 + 0.57 + 0.65) / 3)
    assert (kv.low, kv.high) == (0.57, 0.65)
    # highest in seed 1 (0.57 > 0.55) and seed 2 (a tie counts for both)
    assert kv.highest_in == 2 and ca.highest_in == 2
    assert kv.below_ceiling == pytest.approx((0.10 + 0.03 + 0.01) / 3)
    assert kv.versus_kv is None
    assert ca.versus_kv is not None
    assert (ca.versus_kv.seeds, ca.versus_kv.higher, ca.versus_kv.tied) == (3, 1, 1)
    assert ca.versus_kv.mean_lead == pytest.approx((-0.02 + 0.02 + 0.0) / 3)
    # round robin ran seed 0 only: compared there alone
    assert rr.seeds == 1 and rr.versus_kv is not None
    assert (rr.versus_kv.seeds, rr.versus_kv.higher) == (1, 1)
    assert rr.highest_in == 0

    four = {r.policy: r for r in table[(4, 0)]}
    assert four["kv_aware"].highest_in == 1 and four["cache_aware"].highest_in == 0


def test_the_summary_prints_a_table_per_setup(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = _file(
        tmp_path / "a.json",
        [
            _run("kv_aware", 0, 0.69, restarts=1),
            _run("cache_aware", 0, 0.65, restarts=1),
        ],
        {0: 0.70},
    )
    assert main([str(f)]) == 0
    out = capsys.readouterr().out
    assert "**1 router, 1 restart**" in out
    assert (
        "| cache_aware | 1 | 65.0% | 65.0% to 65.0% | 5.0 points | 0 of 1 | 1 / 0 / 0 "
        "| +4.00 points |" in out
    )
    assert "| kv_aware | 1 | 69.0% |" in out
