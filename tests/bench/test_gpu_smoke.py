"""The H200 benchmark's fast-engine phase, on the CPU (`bench.gpu --smoke`): every system
it starts serves, every run counts every token, so that a run on the lent GPU does not fail
on the benchmark's own code. It measures nothing: the tiny model on vLLM for the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.timeout(900)  # two vLLM engines and four control planes start: about 2 minutes
def test_the_fast_phase_runs_every_system_on_the_cpu(tiny_model_dir: Path, tmp_path: Path) -> None:
    env = {
        k: v for k, v in os.environ.items() if k not in ("SWITCHYARD_BEFORE", "SWITCHYARD_PY_SPY")
    }
    argv = [
        sys.executable, "-m", "bench.gpu", "--smoke", "--phase", "fast",
        "--out", str(tmp_path), "--model-dir", str(tiny_model_dir),
    ]  # fmt: skip
    run = subprocess.run(argv, capture_output=True, text=True, timeout=900, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((tmp_path / "fast.json").read_text())
    [fronts] = result["systems"]
    assert "error" not in fronts, fronts.get("error")
    labels = [r["label"] for r in fronts["runs"]]
    fronts_ = [
        "worker (GenerateStream)",
        "control plane x1",
        "control plane x1, 1 listener",
        "control plane x2",
        "control plane x4",
    ]
    # two passes of each, the second in the opposite order
    assert labels == ["AsyncLLM in-process"] * 2 + fronts_ + fronts_[::-1]
    for r in fronts["runs"]:
        assert r["errors"] == 0, (r["label"], r.get("first_errors"))
        assert r["tokens"] == r["requests"] * 8, r["label"]  # smoke: 8 output tokens a request
    assert fronts["workers_at_start"][0]["engine"].startswith("vllm")
    x4 = [r for r in fronts["runs"] if r["label"] == "control plane x4"]
    assert all(len(r["per_router_cpu_s"]) >= 4 for r in x4)  # the supervisor and 3 more routers
