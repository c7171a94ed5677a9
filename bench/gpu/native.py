"""The native front (`api.front: native`) on the H200, beside grpc.aio, on the 1B shape
of bench.gpu.fast. Run by `bench.gpu --phase PHASE` (scripts/gpu-bench.sh), each within
one device call:

    native:  AsyncLLM in-process; then, in front of one worker that `switchyard serve`
             started: the worker called directly, the control plane in one process on
             grpc.aio and on the native front, and `--routers 2` on the native front;
             two passes in opposite orders; py-spy profiles of the native control plane
    native2: two workers on one GPU: both called directly at once, one native control
             plane in front of both and `--routers 2` native, two rounds alternating;
             then TTFT of single requests, alternating between a worker and the native
             control plane in front of it (TTFT_PAIRS pairs)

The same FAST_SETTINGS and load (1000 streams of 128 prompt and 256 output tokens,
WAVES x 1000 requests) as the fast phases.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import systems
from bench.gpu.common import list_workers, run_load
from bench.gpu.fast import (
    FAST_SETTINGS,
    _both_directly,
    _core,
    _model_yaml,
    _per_process_cores,
    _remote,
    _run,
    _save,
    profiled,
    record_asyncllm,
    served_beside_asyncllm,
)
from bench.gpu.fronts import ttft_pairs

NATIVE = "api: {front: native}\n"


def native_fronts(model: Path, out: Path) -> dict[str, Any]:
    with served_beside_asyncllm(model, out, "native-fronts", "logs-native") as served:
        result, cp, proc = served.result, served.cp, served.proc
        worker = list_workers(cp)[0]["address"]
        record_asyncllm(result, served.beside.run())
        _save(out, result)
        remote = _remote("m", model, [worker])
        ncp, nproc = served.stack.enter_context(
            systems.control_plane(remote, served.logs, "native-1", settings=NATIVE)
        )
        rcp, rproc = served.stack.enter_context(
            systems.control_plane(remote, served.logs, "native-routers-2", 2, settings=NATIVE)
        )
        rpids = [rproc.popen.pid, *systems.descendants(rproc.popen.pid)]
        # label -> (target, address, control-plane pids, profile names -> pids)
        fronts: dict[str, tuple[str, str, list[int], dict[str, int]]] = {
            "worker (GenerateStream)": (
                "worker-stream", worker, [], _core("worker-core", served.worker_pids[0])
            ),
            "control plane x1, grpc.aio": (
                "switchyard", cp, [proc.popen.pid], {"control-aio": proc.popen.pid}
            ),
            "control plane x1, native front": (
                "switchyard", ncp, [nproc.popen.pid], {"control-native": nproc.popen.pid}
            ),
            "control plane x2, native front": ("switchyard", rcp, rpids, {}),
        }  # fmt: skip
        run_load("switchyard", ncp, "m", 64, seed=99, processes=2)  # warm-up
        order = list(fronts)
        for passed, labels in enumerate((order, order[::-1])):
            for label in labels:
                target, address, cp_pids, targets = fronts[label]
                with profiled(out, targets if passed == 0 else {}):
                    cpu = {**served.base, "control": cp_pids}
                    run = _run(result, label, target, address, cpu, out=out, engines=[worker])
                if len(cp_pids) > 1:
                    run["per_router_cpu_s"] = _per_process_cores(cp_pids)
                run["pass"] = passed + 1
        _save(out, result)
    return result


def native_two_workers(model: Path, out: Path) -> dict[str, Any]:
    settings = {**FAST_SETTINGS, "gpu_memory_utilization": 0.42}
    result: dict[str, Any] = {"label": "native-two-workers", "settings": settings, "runs": []}
    logs = out / "logs-native-two"
    logs.mkdir(parents=True, exist_ok=True)
    yaml = _model_yaml("m", model, settings, replicas=2)
    with contextlib.ExitStack() as stack:
        cp, proc = stack.enter_context(systems.control_plane(yaml, logs, settings=NATIVE))
        workers = [w["address"] for w in list_workers(cp)]
        result["workers"] = list_workers(cp)
        remote = _remote("m", model, workers)
        rcp, rproc = stack.enter_context(
            systems.control_plane(remote, logs, "native-routers-2", 2, settings=NATIVE)
        )
        rpids = [rproc.popen.pid, *systems.descendants(rproc.popen.pid)]
        run_load("switchyard", cp, "m", 64, seed=99, processes=2)  # warm-up
        for round_ in range(2):
            result["runs"].append(_both_directly(workers, "both workers directly, at once"))
            cpu = {"control": [proc.popen.pid]}
            with profiled(out, {"control-native-two": proc.popen.pid} if round_ == 0 else {}):
                label = "control plane x1 native, two workers"
                _run(result, label, "switchyard", cp, cpu, engines=workers)
            label = "control plane x2 native, two workers"
            run = _run(result, label, "switchyard", rcp, {"control": rpids}, engines=workers)
            run["per_router_cpu_s"] = _per_process_cores(rpids)
            _save(out, result)
        # TTFT of single requests: the first worker alone, and the native control plane
        # in front of both (so the idle engines answer at once either way).
        result["ttft_pairs"] = ttft_pairs(cp, workers[0], "m")
        _save(out, result)
    return result


def steps(phase: str, model: Path, out: Path) -> list[tuple[str, Callable[[], dict[str, Any]]]]:
    if phase == "native":
        return [("native-fronts", lambda: native_fronts(model, out))]
    return [("native-two-workers", lambda: native_two_workers(model, out))]
