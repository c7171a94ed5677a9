"""The H200 benchmark's fast-engine and tensor-parallel phases, on the CPU (`bench.gpu
--smoke`): every system they start serves, every run counts every token, so that a run on
the lent GPUs does not fail on the benchmark's own code. They measure nothing: the tiny
model on vLLM for the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest


def smoke_phase(phase: str, model: Path, out: Path, unset: tuple[str, ...]) -> dict[str, Any]:
    """`bench.gpu --smoke --phase PHASE` on the tiny model, without the variables
    `unset`; its result (OUT/PHASE.json)."""
    env = {k: v for k, v in os.environ.items() if k not in unset}
    argv = [
        sys.executable, "-m", "bench.gpu", "--smoke", "--phase", phase,
        "--out", str(out), "--model-dir", str(model),
    ]  # fmt: skip
    # inside the tests' own 900 s, so that a hang still shows what the phase printed
    run = subprocess.run(argv, capture_output=True, text=True, timeout=840, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result: dict[str, Any] = json.loads((out / f"{phase}.json").read_text())
    return result


@pytest.mark.timeout(900)  # two vLLM engines and four control planes start: about 2 minutes
def test_the_fast_phase_runs_every_system_on_the_cpu(tiny_model_dir: Path, tmp_path: Path) -> None:
    result = smoke_phase("fast", tiny_model_dir, tmp_path, ("SWITCHYARD_PY_SPY",))
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


@pytest.mark.timeout(900)  # two vLLM engines, one of two ranks: about 3.5 minutes here
@pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="two vLLM-CPU ranks need a CPU each; one here"
)
def test_the_tp_phase_serves_both_parallel_sizes_on_the_cpu(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The two-GPU phase's code on vLLM-CPU, where tensor_parallel_size 2 is two rank
    processes: both sizes serve every stream, say their size, and start their processes
    with NVLink multicast off."""
    from bench.gpu.tp import MULTICAST_OFF, summary

    result = smoke_phase("tp", tiny_model_dir, tmp_path, tuple(MULTICAST_OFF))
    tp1, tp2, topo = result["systems"]
    assert topo["label"] == "nvidia-smi topo"
    for s, size, gpus in ((tp1, 1, ["0"]), (tp2, 2, ["0", "1"])):
        assert "error" not in s, s.get("error")
        assert [int(r["concurrency"]) for r in s["runs"]] == [4, 4, 4, 8, 8, 8]  # smoke loads
        assert all(r["complete"] and r["tokens"] == r["requests"] * 8 for r in s["runs"])
        assert s["get_info"]["tensor_parallel_size"] == size
        (w,) = s["list_workers"]
        assert (w["tensor_parallel_size"], w["gpus"]) == (size, gpus)
        names = [p["process"] for p in s["processes"]]
        assert "VLLM::EngineCore" in names, names
        want = {**MULTICAST_OFF, "CUDA_VISIBLE_DEVICES": ",".join(gpus)}
        assert all(p["env"] == want for p in s["processes"]), s["processes"]
    assert {"VLLM::Worker_TP0", "VLLM::Worker_TP1"} <= {p["process"] for p in tp2["processes"]}
    text = summary(result)
    assert "| TP=2 | 0,1 | 4 | 3 of 3 runs |" in text
    assert "- 8 requests, TP=2 / TP=1: output tok/s " in text
    assert (
        "tp2: GetInfo tensor_parallel_size 2, ListWorkers tensor_parallel_size 2 on GPUs 0,1"
        in text
    )


@pytest.mark.timeout(600)  # one vLLM engine: about a minute here
def test_the_saturate_phase_holds_a_worker_at_its_load_on_the_cpu(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    result = smoke_phase("saturate", tiny_model_dir, tmp_path, ())
    [saturated] = result["systems"]
    assert "error" not in saturated, saturated.get("error")
    [run] = saturated["runs"]
    assert run["label"] == "control plane"
    assert run["complete"] and run["requests"] == 8 * 3  # smoke: 8 at a time, three waves
    assert run["routable_after"] == [True] and run["ejections"] == 0
