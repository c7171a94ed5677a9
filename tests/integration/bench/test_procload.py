"""Load from several processes, the worker-stream target and the CPU proxy, against the
C++ worker on its simulator (benchmarks: these check that they count right, not speed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.load.loadgen import Workload
from bench.load.procload import spread_load
from tests.integration.conformance.conftest import start_cpp_worker


def test_spread_load_counts_every_token_of_every_process(tmp_path: Path) -> None:
    worker = start_cpp_worker(tmp_path)
    try:
        work = Workload(requests=30, prompt_len=(8, 16), output_len=(12, 12), seed=5)
        for target in ("worker", "worker-stream"):
            r = spread_load(target, worker.address, "", work, 9, processes=3, connections=2)
            assert r["errors"] == 0, r["first_errors"]
            assert r["client_processes"] == 3 and len(r["client_busy"]) == 3
            assert r["tokens"] == 30 * 12
            assert r["messages"] >= 30  # at least one message a request
            assert 0 < r["ttft_ms"]["p50"] <= r["ttft_ms"]["p99"]
    finally:
        worker.stop()


def test_the_cpu_proxy_prints_cpu_per_token_for_each_process(tmp_path: Path) -> None:
    """Also with --probe: new requests on fresh connections are timed during the load (it
    lasts about 8 s a run: 200 tokens a stream at 50 tokens/s, twice); and at a stream
    interval of 4, where every stream's chunks carry 4 tokens after the first."""
    out = tmp_path / "proxy.json"
    argv = [
        sys.executable, "-m", "bench.cpu.proxy", "--streams", "16", "--rate", "800",
        "--output", "200", "--routers", "1", "--listeners", "2", "--probe",
        "--intervals", "1", "4", "--json", str(out),
    ]  # fmt: skip
    run = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith("| ")]
    assert lines[0].startswith("| system | tokens/s")
    assert [line.split(" | ")[0] for line in lines[1:]] == [
        "| worker (GenerateStream)",
        "| control plane, 1 process, 2 listeners",
        "| control plane, 1 process, 2 listeners, stream_interval 4",
    ]
    data = json.loads(out.read_text())
    cp, cadenced = data["results"][1], data["results"][2]
    assert cadenced["errors"] == 0
    # 200 tokens a stream: 1, then 4 a chunk (49 chunks), then the last 3 (or more a
    # chunk, where a client falls behind and the tokens ready are merged).
    assert cadenced["tokens_per_message"] >= 3.5, cadenced
    assert cp["tokens_per_message"] < 2, cp
    assert cp["errors"] == 0
    assert cp["cpu_ms_per_1k_tokens"]["control plane"] > 0
    assert cp["cpu_ms_per_1k_tokens"]["workers"] > 0
    assert cp["probe_ttft_ms"]["samples"] > 0
    assert "a new request on its own connection, during the load: TTFT" in run.stdout
