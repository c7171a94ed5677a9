"""How many load processes a rate needs (bench/load/procload.py); the load from several
processes against a real worker: tests/integration/bench/test_procload.py."""

from __future__ import annotations

from bench.load.procload import processes_for


def test_processes_for_follows_the_rate_within_the_cores_and_the_streams() -> None:
    assert processes_for(0, 100, cpus=16) == 1
    assert processes_for(30_000, 1000, cpus=16) == 5
    assert processes_for(1e6, 1000, cpus=16) == 8  # one client per two cores at most
    assert processes_for(1e6, 3, cpus=64) == 3  # never more processes than streams
    assert processes_for(30_000, 1000, cpus=2) == 1
