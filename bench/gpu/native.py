"""The native front (`api.front: native`) on the H200, on the 1B shape of bench.gpu.fast,
three passes of every system, alternating. Run by `bench.gpu --phase PHASE`
(scripts/gpu-bench.sh), each phase within one device call:

    native:  AsyncLLM in-process (three passes); then, in front of one worker that
             `switchyard serve` started: the worker called directly, the control plane
             in one process on the native front and on grpc.aio; py-spy profiles of both
             control planes in the first pass; TTFT of single requests against each front
    native2: two workers on one GPU: both called directly at once, one native control
             plane in front of both and `--routers 2` native; then TTFT of single
             requests, alternating between a worker and the control plane in front
    native3: the peers: vLLM's gRPC server and SMG's gateway in front of it (started
             beside `switchyard serve`, with the same settings), the worker and the
             native control plane, in turn

The same FAST_SETTINGS and load (1000 streams of 128 prompt and 256 output tokens,
WAVES x 1000 requests) as the fast phases.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import systems
from bench.gpu.common import list_workers, run_load
from bench.gpu.fast import (
    FAST_SETTINGS,
    LOAD,
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
AIO = "api: {front: python}\n"
PASSES = 3


def _orders(labels: list[str]) -> list[list[str]]:
    """PASSES orders of the systems: forwards, backwards, forwards..."""
    return [labels if i % 2 == 0 else labels[::-1] for i in range(PASSES)]


def native_fronts(model: Path, out: Path) -> dict[str, Any]:
    with served_beside_asyncllm(
        model, out, "native-fronts", "logs-native", reps=PASSES, extra=AIO
    ) as served:
        result, cp, proc = served.result, served.cp, served.proc
        worker = list_workers(cp)[0]["address"]
        record_asyncllm(result, served.beside.run())
        _save(out, result)
        remote = _remote("m", model, [worker])
        ncp, nproc = served.stack.enter_context(
            systems.control_plane(remote, served.logs, "native-1", settings=NATIVE)
        )
        # label -> (target, address, control-plane pids, profile names -> pids)
        fronts: dict[str, tuple[str, str, list[int], dict[str, int]]] = {
            "worker (GenerateStream)": (
                "worker-stream", worker, [], _core("worker-core", served.worker_pids[0])
            ),
            "control plane x1, native front": (
                "switchyard", ncp, [nproc.popen.pid], {"control-native": nproc.popen.pid}
            ),
            "control plane x1, grpc.aio": (
                "switchyard", cp, [proc.popen.pid], {"control-aio": proc.popen.pid}
            ),
        }  # fmt: skip
        run_load("switchyard", ncp, "m", 64, seed=99, processes=2)  # warm-up
        for passed, labels in enumerate(_orders(list(fronts))):
            for label in labels:
                target, address, cp_pids, targets = fronts[label]
                with profiled(out, targets if passed == 0 else {}):
                    cpu = {**served.base, "control": cp_pids}
                    run = _run(result, label, target, address, cpu, out=out, engines=[worker])
                run["pass"] = passed + 1
        result["ttft_pairs"] = {
            "native": ttft_pairs(ncp, worker, "m"),
            "grpc.aio": ttft_pairs(cp, worker, "m"),
        }
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
        direct = "both workers directly, at once"
        one, two = "control plane x1 native, two workers", "control plane x2 native, two workers"
        for round_, labels in enumerate(_orders([direct, one, two])):
            for label in labels:
                if label == direct:
                    run = _both_directly(workers, direct)
                    result["runs"].append(run)
                elif label == one:
                    targets = {"control-native-two": proc.popen.pid} if round_ == 0 else {}
                    with profiled(out, targets):
                        cpu = {"control": [proc.popen.pid]}
                        run = _run(result, label, "switchyard", cp, cpu, engines=workers)
                else:
                    cpu = {"control": rpids}
                    run = _run(result, label, "switchyard", rcp, cpu, engines=workers)
                    run["per_router_cpu_s"] = _per_process_cores(rpids)
                run["pass"] = round_ + 1
                _save(out, result)
        # TTFT of single requests: the first worker alone, and the native control plane
        # in front of both (so the idle engines answer at once either way).
        result["ttft_pairs"] = ttft_pairs(cp, workers[0], "m")
        _save(out, result)
    return result


def _started_together(
    stack: contextlib.ExitStack, *starts: contextlib.AbstractContextManager[Any]
) -> list[Any]:
    """Enter the context managers at once (each engine loads while the others do), and
    leave them with `stack`."""
    with concurrent.futures.ThreadPoolExecutor(len(starts)) as pool:
        futures = [pool.submit(s.__enter__) for s in starts]
        values: list[Any] = []
        for start, future in zip(starts, futures, strict=True):
            try:
                values.append(future.result())
            finally:
                if future.exception() is None:
                    stack.push(start)
    return values


def native_peers(model: Path, out: Path) -> dict[str, Any]:
    settings = {**FAST_SETTINGS, "gpu_memory_utilization": 0.42}
    result: dict[str, Any] = {"label": "native-peers", "settings": settings, "runs": []}
    logs = out / "logs-native-peers"
    logs.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        serve = systems.control_plane(_model_yaml("m", model, settings), logs, settings=NATIVE)
        peer = systems.vllm_grpc_server(model, logs, settings)
        (cp, proc), vgrpc = _started_together(stack, serve, peer)
        result["start_s"] = time.monotonic() - started
        smg = stack.enter_context(systems.smg_gateway(vgrpc.address, logs))
        worker = list_workers(cp)[0]["address"]
        vllm_pids = [vgrpc.pid, *systems.descendants(vgrpc.pid)]
        smg_pids = [smg.pid, *systems.descendants(smg.pid)]
        # label -> (target, address, model name, pids to meter)
        systems_: dict[str, tuple[str, str, str, dict[str, list[int]]]] = {
            "worker (GenerateStream)": ("worker-stream", worker, "m", {}),
            "control plane x1, native front": (
                "switchyard", cp, "m", {"control": [proc.popen.pid]}
            ),
            "vLLM gRPC server": ("vllm-grpc", vgrpc.address, str(model), {"server": vllm_pids}),
            "SMG gateway -> vLLM gRPC server": (
                "smg", smg.address, str(model), {"gateway": smg_pids, "server": vllm_pids}
            ),
        }  # fmt: skip
        run_load("switchyard", cp, "m", 64, seed=99, processes=2)  # warm-up
        run_load("smg", smg.address, str(model), 64, seed=99, processes=2)
        for passed, labels in enumerate(_orders(list(systems_))):
            for label in labels:
                target, address, name, cpu = systems_[label]
                engines = [worker] if name == "m" else []
                run = _run(result, label, target, address, cpu, LOAD, out, engines, name)
                run["pass"] = passed + 1
    return result


def steps(phase: str, model: Path, out: Path) -> list[tuple[str, Callable[[], dict[str, Any]]]]:
    if phase == "native":
        return [("native-fronts", lambda: native_fronts(model, out))]
    if phase == "native3":
        return [("native-peers", lambda: native_peers(model, out))]
    return [("native-two-workers", lambda: native_two_workers(model, out))]
