"""The load generator against a real worker (the C++ worker on its simulator)."""

from __future__ import annotations

from pathlib import Path

from bench.load.loadgen import WorkerTarget, Workload, closed_loop, open_loop, summarize
from tests.integration.conformance.conftest import start_cpp_worker


async def test_closed_and_open_loop_record_every_request(tmp_path: Path) -> None:
    worker = start_cpp_worker(tmp_path)
    try:
        work = Workload(requests=24, prompt_len=(16, 64), output_len=(8, 32), seed=3)
        target = WorkerTarget(worker.address)
        records = await closed_loop(target, work, concurrency=4)
        s = summarize("worker", "closed", 4, records)
        assert s.requests == 24 and s.errors == 0
        expected = sum(n for _, n in work.items())
        assert round(s.output_tokens_per_s * s.duration_s) == expected
        assert 0 < s.ttft_ms["p50"] <= s.ttft_ms["p99"] < s.e2e_ms["p99"]
        assert s.itl_ms["p50"] > 0
        opened = await open_loop(target, Workload(requests=10, seed=4), rate=50)
        assert len(opened) == 10 and all(r.error is None for r in opened)
        await target.close()
    finally:
        worker.stop()


def test_command_line_runs_closed_and_open_loop_and_writes_json(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    worker = start_cpp_worker(tmp_path)
    out = tmp_path / "runs.json"
    argv = [
        sys.executable, "-m", "bench.load", "--target", "worker",
        "--address", worker.address, "--concurrency", "1,4", "--rate", "40",
        "--requests", "12", "--prompt-len", "8-32", "--output-len", "16",
        "--json", str(out),
    ]  # fmt: skip
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    finally:
        worker.stop()
    assert done.returncode == 0, done.stderr
    runs = json.loads(out.read_text())
    assert [(r["mode"], r["load"]) for r in runs] == [("open", 40), ("closed", 1), ("closed", 4)]
    assert all(r["requests"] == 12 and r["errors"] == 0 for r in runs)
    assert "closed 4:" in done.stdout and "tok/s" in done.stdout
