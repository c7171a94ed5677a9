"""Tensor parallelism on two H200s (`bench.gpu --phase tp`, on the nvidia-h200-x2 kind):
the 8B shape served by `switchyard serve` starting its vLLM worker, once with
`tensor_parallel_size: 1` on GPU 0 (`gpus: [0]`) and once with `tensor_parallel_size: 2`
on GPUs 0 and 1 (`gpus: [0, 1]`), in one run. For each: the guide's workload through the
control plane (bench.gpu's LOADS, REPS runs each; every stream must complete), its
throughput and TTFT p50/p99, nvidia-smi's memory of each GPU while it runs, what GetInfo
and ListWorkers say of the parallel size, and the NCCL settings each of the worker's
processes was started with.

NVLink multicast stays off (MULTICAST_OFF, set in this process's environment, which the
control plane, its worker and vLLM's rank processes inherit), as that machine requires.

    python -m bench.gpu.tp --summary DIR/tp.json    # the comparison, as Markdown

`--phase saturate` (one GPU is enough) holds TP=1 at 1000 concurrent requests for three
waves, so that the canary queues behind the load for longer than three of its intervals:
whether every stream completes and the worker stays in.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from bench import systems
from bench.gpu import common as gpu

log = structlog.get_logger(__name__)

MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
REPS = 3
SATURATE_WAVES = 3
SHAPES = ((1, ("0",)), (2, ("0", "1")))  # (tensor_parallel_size, gpus)
MEMORY_QUERY = "timestamp,index,memory.used,memory.total"


def quiet_multicast() -> None:
    """NVLink multicast off in this process and everything it starts; SPT_NOENV keeps
    what vLLM's renamed processes were started with readable in /proc."""
    os.environ.update(MULTICAST_OFF)
    os.environ["SPT_NOENV"] = "1"


def gpu_memory(csv: str) -> dict[str, dict[str, float]]:
    """Per GPU index, from nvidia-smi's samples (MEMORY_QUERY, MiB): the highest memory
    in use, its total, and the number of samples."""
    out: dict[str, dict[str, float]] = {}
    for line in csv.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 4:
            continue
        try:
            used, total = float(parts[2]), float(parts[3])
        except ValueError:
            continue
        seen = out.setdefault(parts[1], {"peak_used_mib": 0.0, "total_mib": total, "samples": 0})
        seen["peak_used_mib"] = max(seen["peak_used_mib"], used)
        seen["samples"] += 1
    return out


def get_info(address: str) -> dict[str, Any]:
    import grpc
    from google.protobuf import json_format
    from switchyard.worker.v1 import worker_pb2, worker_pb2_grpc

    with grpc.insecure_channel(address) as ch:
        r = worker_pb2_grpc.WorkerStub(ch).GetInfo(worker_pb2.GetInfoRequest(), timeout=10)
    return json_format.MessageToDict(r, preserving_proto_field_name=True)


def process_envs(pid: int) -> list[dict[str, Any]]:
    """Each process below `pid` (the worker, vLLM's engine core and ranks): its name and
    the multicast settings and CUDA_VISIBLE_DEVICES it was started with."""
    names = (*MULTICAST_OFF, "CUDA_VISIBLE_DEVICES")
    out = []
    for child in systems.descendants(pid):
        try:
            cmd = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # gone since
        env = systems.process_env(child, names)
        if env is None:
            continue
        name = " ".join(c.decode(errors="replace") for c in cmd[:3]).strip()[:80]
        out.append({"pid": child, "process": name, "env": env})
    return out


def served(
    model: Path, out: Path, settings: dict[str, Any], tp: int, gpus: tuple[str, ...]
) -> dict[str, Any]:
    label = f"tp{tp}"
    settings = {**settings, "tensor_parallel_size": tp}
    result: dict[str, Any] = {
        "label": label, "tensor_parallel_size": tp, "gpus": list(gpus), "settings": settings,
        "runs": [],
    }  # fmt: skip
    log_dir = out / f"logs-{label}"  # packed by scripts/gpu-bench.sh, CSVs included
    log_dir.mkdir(parents=True, exist_ok=True)
    entry = gpu.served_model("m", model, settings, gpus)
    started = time.monotonic()
    with systems.control_plane(entry, log_dir) as (cp, proc):
        result["start_s"] = time.monotonic() - started
        workers = gpu.list_workers(cp)
        result["list_workers"] = workers
        result["get_info"] = get_info(workers[0]["address"])
        result["processes"] = process_envs(proc.popen.pid)
        gpu.run_load("switchyard", cp, "m", 32, seed=99)  # warm-up
        for load in gpu.LOADS:
            csv = log_dir / f"gpu-memory-{load}.csv"
            with gpu.gpu_memory_sampler(csv, query=MEMORY_QUERY):
                for rep in range(REPS):
                    run = gpu.run_load("switchyard", cp, "m", load, seed=1 + rep)
                    run["label"] = label
                    run["complete"] = run["errors"] == 0 and run["tokens"] == load * gpu.OUTPUT
                    log.info(
                        "run", label=label, requests=load, rep=rep, complete=run["complete"],
                        tokens_per_s=round(run["tokens_per_s"]),
                        ttft_p50_ms=run["ttft_ms"].get("p50"),
                    )  # fmt: skip
                    result["runs"].append(run)
                if load == gpu.LOADS[0]:
                    result["workers_under_load"] = gpu.list_workers(cp)
            if csv.exists():
                result.setdefault("gpu_memory", {})[str(load)] = gpu_memory(csv.read_text())
        result["log_tail"] = proc.log_tail(40)
    return result


def saturated(model: Path, out: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """TP=1 on GPU 0 held at LOADS[-1] concurrent requests, SATURATE_WAVES times as many in
    all (closed loop), so that the canary waits behind the queue for longer than the
    failure threshold's canaries take, through the control plane."""
    load = gpu.LOADS[-1]
    result: dict[str, Any] = {"label": "saturated", "settings": settings, "runs": []}
    entry = gpu.served_model("m", model, settings, ("0",))
    log_dir = out / "logs-saturated"
    log_dir.mkdir(parents=True, exist_ok=True)
    with systems.control_plane(entry, log_dir) as (cp, proc):
        gpu.run_load("switchyard", cp, "m", 32, seed=99)  # warm-up
        run = gpu.run_load("switchyard", cp, "m", load, seed=7, waves=SATURATE_WAVES)
        workers = gpu.list_workers(cp)
        text = proc.log_path.read_text(errors="replace")
    run.update(
        label="control plane",
        complete=run["errors"] == 0 and run["tokens"] == run["requests"] * gpu.OUTPUT,
        circuit_after=[w.get("circuit") for w in workers],
        routable_after=[bool(w.get("routable")) for w in workers],
        ejections=text.count("worker ejected"),
        canaries_timed_out=len(re.findall(r"generate deadline expired\s+request_id=canary", text)),
    )
    log.info(
        "saturated", complete=run["complete"], errors=run["errors"],
        ejections=run["ejections"], canaries_timed_out=run["canaries_timed_out"],
        tokens_per_s=round(run["tokens_per_s"]),
    )  # fmt: skip
    result["runs"].append(run)
    return result


def steps(model: Path, out: Path) -> list[tuple[str, Callable[[], dict[str, Any]]]]:
    quiet_multicast()
    settings = dict(gpu.SETTINGS)

    def one(tp: int, gpus: tuple[str, ...]) -> Callable[[], dict[str, Any]]:
        return lambda: served(model, out, settings, tp, gpus)

    result = [(f"tp{tp}", one(tp, gpus)) for tp, gpus in SHAPES]
    result.append(("nvidia-smi topo", topology))
    return result


def saturate_steps(model: Path, out: Path) -> list[tuple[str, Callable[[], dict[str, Any]]]]:
    quiet_multicast()
    settings = dict(gpu.SETTINGS)
    return [("saturated", lambda: saturated(model, out, settings))]


def topology() -> dict[str, Any]:
    """How the GPUs are linked (nvidia-smi topo -m), not yet recorded for that kind."""
    try:
        text = subprocess.run(
            ["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30
        ).stdout
    except OSError as exc:
        text = f"no nvidia-smi: {exc}"
    return {"label": "nvidia-smi topo", "topology": text}


# ---- the comparison ---------------------------------------------------------------------


def _median(runs: list[dict[str, Any]], key: str, sub: str = "") -> float:
    values = [
        float(r[key][sub]) if sub else float(r[key]) for r in runs if not sub or sub in r[key]
    ]
    return statistics.median(values) if values else float("nan")


def failure(error: str) -> str:
    """What the operator reads of a system that did not start: the control plane's own
    last "startup failed" error, on one line, else the error's last line."""
    flat = " ".join(error.split())
    said = flat.rpartition("startup failed")[2].strip()
    if said.startswith("error="):
        return said.removeprefix("error=").strip("'\"")[:400]
    return (error.strip().splitlines() or [""])[-1][:400]


def summary(result: dict[str, Any]) -> str:
    """TP=2 against TP=1, load by load: medians of the runs, and the ratios."""
    by_label = {s["label"]: s for s in result["systems"] if "runs" in s}
    lines = [
        "| system | GPUs | requests | complete | output tok/s | TTFT p50 ms | TTFT p99 ms "
        "| GPU memory in use (peak, MiB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    by: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for label, s in by_label.items():
        for r in s["runs"]:
            by.setdefault((label, int(r["concurrency"])), []).append(r)
    for (label, load), runs in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        s = by_label[label]
        mem = s.get("gpu_memory", {}).get(str(load), {})
        memory = ", ".join(
            f"GPU {i}: {v['peak_used_mib']:,.0f} of {v['total_mib']:,.0f}"
            for i, v in sorted(mem.items())
        )
        complete = sum(1 for r in runs if r.get("complete"))
        lines.append(
            f"| TP={s['tensor_parallel_size']} | {','.join(s['gpus'])} | {load} "
            f"| {complete} of {len(runs)} runs | {_median(runs, 'tokens_per_s'):,.0f} "
            f"| {_median(runs, 'ttft_ms', 'p50'):.0f} | {_median(runs, 'ttft_ms', 'p99'):.0f} "
            f"| {memory or 'not sampled'} |"
        )
    lines.append("")
    for load in sorted({load for _, load in by}):
        one, two = by.get(("tp1", load)), by.get(("tp2", load))
        if one and two:
            lines.append(
                f"- {load} requests, TP=2 / TP=1: output tok/s "
                f"{_median(two, 'tokens_per_s') / _median(one, 'tokens_per_s'):.2f}, TTFT p50 "
                f"{_median(two, 'ttft_ms', 'p50') / _median(one, 'ttft_ms', 'p50'):.2f}, "
                f"TTFT p99 {_median(two, 'ttft_ms', 'p99') / _median(one, 'ttft_ms', 'p99'):.2f}"
            )
    for s in result["systems"]:
        if "error" in s:
            lines.append(f"- {s['label']}: did not serve: {failure(s['error'])}")
    for label, s in by_label.items():
        (w,) = s["list_workers"][:1] or [{}]
        info = s.get("get_info", {})
        lines.append(
            f"- {label}: GetInfo tensor_parallel_size {info.get('tensor_parallel_size', 1)}, "
            f"ListWorkers tensor_parallel_size {w.get('tensor_parallel_size', 1)} on GPUs "
            f"{','.join(w.get('gpus', [])) or '(unset)'}; started in {s['start_s']:.0f} s"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--summary", type=Path, required=True, help="a tp.json")
    args = p.parse_args()
    print(summary(json.loads(args.summary.read_text())))


if __name__ == "__main__":
    main()
