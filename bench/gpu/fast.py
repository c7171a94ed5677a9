"""A fast engine on the H200: a Llama-3.2-1B shape, where the fronts, not the GPU, set
the pace. Run by `bench.gpu --phase PHASE` (scripts/gpu-bench.sh):

    fast:  AsyncLLM in-process; `switchyard serve` with its vLLM worker: the worker called
           directly (GenerateStream), the control plane in one process, and router-only
           control planes (one process with a single gRPC listener; 2 and 4 processes)
           in front of the same worker; py-spy profiles of the worker and the control plane
    fast2: two workers on one GPU behind one control plane and behind router-only control
           planes; vLLM's gRPC and OpenAI servers

Every system gets FAST_SETTINGS; 1000 concurrent requests of 128 prompt and 256 output
tokens (ignore_eos), WAVES times as many in all, load from CLIENTS processes over
CONNECTIONS channels each.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import structlog

from bench import systems
from bench.gpu.common import (
    SETTINGS,
    SMOKE_ENV,
    asyncllm_argv,
    list_workers,
    run_load,
    served_model,
)
from bench.gpu.common import peer as gpu_peer
from bench.load.procload import start_delay_s

log = structlog.get_logger(__name__)

# The same KV cache for every engine, however the GPU's memory is shared out: 32,768
# blocks of 16 tokens hold all 1000 requests (384 tokens each) twice over. Without it,
# an engine that starts beside another measures the other's memory as its own and gets a
# smaller cache (6,564 blocks, seen on the H200: a quarter of the requests waited).
FAST_SETTINGS: dict[str, Any] = {
    **SETTINGS,
    "max_num_seqs": 1024,
    "num_gpu_blocks_override": 32768,
}
LOAD = 1000
# Each run of the fast phase: WAVES x LOAD requests, LOAD at a time. One wave (the first
# H200 runs) lasts 8-16 s, and its start and tail made two passes of one system differ by
# up to 30%.
WAVES = 2
CLIENTS = 6
PROFILE_S = 10.0
ROUTERS = (2, 4)  # router-only control planes beside the one process
TWO_WORKER_ROUTERS = (4, 8)  # in front of two workers (68k tokens/s between them)
if os.environ.get(SMOKE_ENV):  # a CPU check of the code paths (bench.gpu --smoke)
    FAST_SETTINGS = {**SETTINGS, "max_num_seqs": 64}
    LOAD, CLIENTS, PROFILE_S = 16, 2, 2.0


def _model_yaml(name: str, model: Path, settings: dict[str, Any], replicas: int = 1) -> str:
    text = served_model(name, model, settings)
    return text + (f"    replicas: {replicas}\n" if replicas > 1 else "")


def _remote(name: str, model: Path, workers: list[str]) -> str:
    return (
        f"  - name: {name}\n    engine: vllm\n    model: {model}\n"
        f"    workers: [{', '.join(workers)}]\n"
        "    limits: {max_concurrency: 4096, max_queue: 4096}\n"
    )


def _pids_named(root: int, needle: str) -> list[int]:
    out = []
    for pid in systems.descendants(root):
        with contextlib.suppress(OSError):
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            if needle in cmd:
                out.append(pid)
    return out


def _core(name: str, root: int) -> dict[str, int]:
    """The engine-core process under `root`, named for a profile (nothing if not found):
    vLLM titles it EngineCore where setproctitle is installed; else it is the child that
    multiprocessing spawned."""
    pids = _pids_named(root, "EngineCore") or _pids_named(root, "spawn_main")
    return {name: pids[0]} if pids else {}


def cpu_probe_ms(rounds: int = 3) -> float:
    """The best of `rounds` timings of a fixed pure-Python loop, in ms."""
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        total = 0
        for i in range(300_000):
            total += i * i
        best = min(best, (time.perf_counter() - t) * 1000)
    return round(best, 2)


def _steal() -> Callable[[], float]:
    """The fraction of all CPU time stolen (by other guests) from now to the call."""

    def read() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
        return (fields[7] if len(fields) > 7 else 0), sum(fields)

    s0, t0 = read()

    def done() -> float:
        s1, t1 = read()
        return round((s1 - s0) / max(1, t1 - t0), 4)

    return done


def _cores(pids: list[int]) -> Callable[[], float]:
    """CPU seconds of `pids` since this call, as a function to call at the end."""
    start = systems.cpu_seconds(pids)
    return lambda: systems.cpu_seconds(pids) - start


@contextlib.contextmanager
def profiled(
    out: Path, targets: dict[str, int], delay_s: float = 6.0, seconds: float = PROFILE_S
) -> Iterator[None]:
    """py-spy (SWITCHYARD_PY_SPY) on each process for `seconds`, `delay_s` into the run:
    collapsed stacks in OUT/profile-NAME.txt."""
    spy = (os.environ.get("SWITCHYARD_PY_SPY") or shutil.which("py-spy")) if targets else None
    procs: list[subprocess.Popen[bytes]] = []

    def go() -> None:
        time.sleep(delay_s)
        for name, pid in targets.items():
            argv = [
                str(spy), "record", "--nonblocking", "-p", str(pid),
                "-d", str(max(1, round(seconds))), "-r", "100",
                "--format", "raw", "-o", str(out / f"profile-{name}.txt"),
            ]  # fmt: skip
            quiet = subprocess.DEVNULL
            procs.append(subprocess.Popen(argv, stdout=quiet, stderr=quiet))

    thread = threading.Thread(target=go, daemon=True)
    if spy:
        thread.start()
    try:
        yield
    finally:
        if spy:
            thread.join()
            for p in procs:
                try:
                    p.wait(seconds + 30)
                except subprocess.TimeoutExpired:
                    p.kill()


def _run(
    result: dict[str, Any],
    label: str,
    target: str,
    address: str,
    cpu: dict[str, list[int]],
    requests: int = LOAD,
    out: Path | None = None,
    engines: list[str] | None = None,
    model: str = "m",
) -> dict[str, Any]:
    meters = {name: _cores(pids) for name, pids in cpu.items()}
    probe_before = cpu_probe_ms()
    steal = _steal()
    started = time.monotonic()
    batches: dict[str, Any] = {}
    with systems.engine_batches(engines or [], batches):
        run = run_load(target, address, model, requests, seed=1, processes=CLIENTS, waves=WAVES)
    wall = time.monotonic() - started
    run.update(batches)
    # How fast this host's CPUs were around the run (a shared machine's speed varies):
    # a fixed pure-Python loop's time before and after, and the CPU time stolen by others.
    run["cpu_probe_ms"] = [probe_before, cpu_probe_ms()]
    run["steal_fraction"] = steal()
    run["label"] = label
    run["cores_busy"] = {name: round(m() / wall, 2) for name, m in meters.items()}
    log.info(
        "run",
        system=label,
        tokens_per_s=round(run["tokens_per_s"]),
        errors=run["errors"],
        cores=run["cores_busy"],
        clients_busy=run["client_busy"],
        engine=run.get("engine"),
    )
    result["runs"].append(run)
    if out is not None:
        _save(out, result)
    return run


class _AsyncLLMBeside:
    """vLLM's AsyncLLM in its own process, started beside `switchyard serve` (both
    engines load at once: one start's wait), run only when told, so the two never
    share the GPU's time."""

    def __init__(self, model: Path, settings: dict[str, Any], reps: int = 2) -> None:
        argv = [*asyncllm_argv(model, settings, (LOAD,), WAVES), "--go", "--reps", str(reps)]
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith("READY"):
                self.ready.set()
        self.ready.set()  # it ended (or failed): nobody waits for nothing

    def run(self, timeout_s: float = 300.0) -> list[dict[str, Any]]:
        self.ready.wait(timeout_s)
        assert self.proc.stdin is not None
        with contextlib.suppress(OSError):  # it may have failed already
            self.proc.stdin.write("go\n")
            self.proc.stdin.flush()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._reader.join(10)
        return [json.loads(x[7:]) for x in self.lines if x.startswith("RESULT ")]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@dataclasses.dataclass
class Served:
    """A phase's `switchyard serve` (one worker, 0.42 of the GPU) with AsyncLLM beside it
    (`served_beside_asyncllm`): the result being filled, the stack later control planes
    join, and the pids whose CPU every run records."""

    result: dict[str, Any]
    stack: contextlib.ExitStack
    logs: Path
    cp: str
    proc: systems.Proc
    beside: _AsyncLLMBeside
    worker_pids: list[int]
    base: dict[str, list[int]]  # the worker's and its engine's pids


@contextlib.contextmanager
def served_beside_asyncllm(
    model: Path, out: Path, label: str, logs: str, reps: int = 2, extra: str = ""
) -> Iterator[Served]:
    """`switchyard serve` on the model with AsyncLLM loading beside it (stopped at the
    end; `reps` passes when told). Every engine gets 0.42 of the GPU's memory (two share
    it); the KV cache still holds every request. `extra`: top-level config lines."""
    settings = {**FAST_SETTINGS, "gpu_memory_utilization": 0.42}
    result: dict[str, Any] = {"label": label, "settings": settings, "runs": []}
    log_dir = out / logs
    log_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    beside = _AsyncLLMBeside(model, settings, reps)
    try:
        with contextlib.ExitStack() as stack:
            yaml = _model_yaml("m", model, settings)
            cp, proc = stack.enter_context(systems.control_plane(yaml, log_dir, settings=extra))
            result["start_s"] = time.monotonic() - started
            worker_pids = _pids_named(proc.popen.pid, "pyworker")
            engine = [p for w in worker_pids for p in systems.descendants(w)]
            base = {"worker": worker_pids, "engine": engine}
            yield Served(result, stack, log_dir, cp, proc, beside, worker_pids, base)
    finally:
        beside.stop()


def fronts(model: Path, out: Path) -> dict[str, Any]:
    """AsyncLLM in-process (two passes), then, on one worker started by `switchyard
    serve`, two passes in opposite orders of: the worker called directly, the control
    plane in one process, router-only control planes (one process with one gRPC
    listener; 2 and 4 processes), all in front of the same worker. Profiles in the
    first pass; the second pass profiles the control plane's start of 1000 requests."""
    with served_beside_asyncllm(model, out, "fast-fronts", "logs-fast") as served:
        result, cp, proc = served.result, served.cp, served.proc
        worker_pids = served.worker_pids
        workers = list_workers(cp)
        result["workers_at_start"] = workers
        worker = workers[0]["address"]
        # Its own process and its engine core, to set beside the worker's (profiles
        # from 2 s into its first pass).
        pid = served.beside.proc.pid
        with profiled(out, {"asyncllm": pid, **_core("asyncllm-core", pid)}, 2.0):
            asyncllm = served.beside.run()
        result["asyncllm"] = asyncllm
        record_asyncllm(result, asyncllm)
        _save(out, result)
        # label -> (target, address, control-plane pids, profile names -> pids)
        fronts_: dict[str, tuple[str, str, list[int], dict[str, int]]] = {
            "worker (GenerateStream)": (
                "worker-stream", worker, [],
                {"worker-direct": worker_pids[0], **_core("worker-core", worker_pids[0])},
            ),
            "control plane x1": (
                "switchyard", cp, [proc.popen.pid],
                {"control": proc.popen.pid, "worker": worker_pids[0]},
            ),
        }  # fmt: skip
        remote = _remote("m", model, [worker])
        ocp, oproc = served.stack.enter_context(
            systems.control_plane(remote, served.logs, "listener-1", 1, listeners=1)
        )
        fronts_["control plane x1, 1 listener"] = ("switchyard", ocp, [oproc.popen.pid], {})
        for n in ROUTERS:
            rcp, rproc = served.stack.enter_context(
                systems.control_plane(remote, served.logs, f"routers-{n}", n)
            )
            rpids = [rproc.popen.pid, *systems.descendants(rproc.popen.pid)]
            fronts_[f"control plane x{n}"] = ("switchyard", rcp, rpids, {})
        run_load("switchyard", cp, "m", 64, seed=99, processes=2)  # warm-up
        order = list(fronts_)
        for passed, labels in enumerate((order, order[::-1])):
            for label in labels:
                target, address, cp_pids, targets = fronts_[label]
                cpu = {**served.base, "control": cp_pids}
                delay, seconds = 6.0, PROFILE_S
                if passed == 1:
                    targets = {}
                    if label == "control plane x1":  # the burst: 1000 requests at once
                        # from when the clients start sending (the first H200 run
                        # began at 0.5 s and caught one sample, before any load)
                        burst = {"control-burst": proc.popen.pid}
                        targets, delay, seconds = burst, start_delay_s(CLIENTS) + 0.2, 3.0
                with profiled(out, targets, delay, seconds):
                    run = _run(result, label, target, address, cpu, out=out, engines=[worker])
                if len(cp_pids) > 1:
                    run["per_router_cpu_s"] = _per_process_cores(cp_pids)
                run["pass"] = passed + 1
        result["workers_under_load"] = list_workers(cp)
        _save(out, result)
    return result


def record_asyncllm(result: dict[str, Any], runs: list[dict[str, Any]]) -> None:
    """AsyncLLM's passes among the result's runs, labelled and logged."""
    for r in runs:
        r["label"] = "AsyncLLM in-process"
        result["runs"].append(r)
        log.info("run", system="asyncllm", tokens_per_s=round(r["tokens_per_s"]))


def _save(out: Path, result: dict[str, Any]) -> None:
    (out / f"{result['label']}.json").write_text(json.dumps(result, indent=1))


def _per_process_cores(pids: list[int]) -> dict[str, float]:
    """CPU seconds each process has used so far (how the load spread over routers)."""
    return {str(pid): round(systems.cpu_seconds([pid]), 1) for pid in pids}


def _both_directly(workers: list[str], label: str) -> dict[str, Any]:
    """Both workers called directly at once, half the load each."""
    both: list[dict[str, Any]] = []
    batches: dict[str, Any] = {}

    def one(address: str) -> None:
        both.append(run_load("worker-stream", address, "m", LOAD // 2, 1, processes=3, waves=WAVES))

    threads = [threading.Thread(target=one, args=(w,)) for w in workers]
    with systems.engine_batches(workers, batches):
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    combined = {
        "label": label,
        "system": "worker-stream x2",
        "requests": sum(r["requests"] for r in both),
        "tokens": sum(r["tokens"] for r in both),
        # both ran at once: all their tokens over the longer of the two runs
        "tokens_per_s": sum(r["tokens"] for r in both) / max(r["seconds"] for r in both),
        "errors": sum(r["errors"] for r in both),
        "parts": both,
        **batches,
    }
    log.info("run", system=label, tokens_per_s=round(combined["tokens_per_s"]))
    return combined


def two_workers(model: Path, out: Path) -> dict[str, Any]:
    """Two workers on one GPU (each with under half of its memory): both called directly
    at once, then one control plane in front of both, twice; then router-only control
    planes (TWO_WORKER_ROUTERS processes) in front of both."""
    settings = {**FAST_SETTINGS, "gpu_memory_utilization": 0.42}
    result: dict[str, Any] = {"label": "fast-two-workers", "settings": settings, "runs": []}
    logs = out / "logs-two"
    logs.mkdir(parents=True, exist_ok=True)
    with systems.control_plane(_model_yaml("m", model, settings, replicas=2), logs) as (cp, proc):
        workers = [w["address"] for w in list_workers(cp)]
        result["workers"] = list_workers(cp)
        worker_pids = _pids_named(proc.popen.pid, "pyworker")
        run_load("switchyard", cp, "m", 64, seed=99, processes=2)
        for round_ in range(2):
            result["runs"].append(_both_directly(workers, "both workers directly, at once"))
            cpu = {"control": [proc.popen.pid]}
            with profiled(out, {"control-two": proc.popen.pid} if round_ == 0 else {}):
                label = "control plane x1, two workers"
                _run(result, label, "switchyard", cp, cpu, engines=workers)
        for n in TWO_WORKER_ROUTERS:
            remote = _remote("m", model, workers)
            with systems.control_plane(remote, logs, f"routers-{n}", n) as (rcp, rp):
                children = systems.descendants(rp.popen.pid)
                rpids = [rp.popen.pid, *children]
                # two of its routers, and both workers (what the routers wait on)
                targets = {f"router{n}-{i}": pid for i, pid in enumerate(children[:2])}
                targets |= {f"worker{n}-{i}": pid for i, pid in enumerate(worker_pids[:2])}
                with profiled(out, targets):
                    cpu = {"control": rpids}
                    label = f"control plane x{n}, two workers"
                    run = _run(result, label, "switchyard", rcp, cpu, engines=workers)
                run["per_router_cpu_s"] = _per_process_cores(rpids)
    return result


def peer(kind: str, model: Path, out: Path) -> dict[str, Any]:
    return gpu_peer(
        kind,
        model,
        out,
        FAST_SETTINGS,
        (LOAD, LOAD),
        processes=CLIENTS,
        label=f"fast-{kind}",
        waves=WAVES,
    )


def steps(phase: str, model: Path, out: Path) -> list[tuple[str, Callable[[], dict[str, Any]]]]:
    if phase == "fast":
        return [("fronts", lambda: fronts(model, out))]
    return [
        ("two-workers", lambda: two_workers(model, out)),
        ("vllm-grpc", lambda: peer("vllm-grpc", model, out)),
        ("openai", lambda: peer("openai", model, out)),
    ]
