"""CPU time per token of the control plane, with C++ simulator workers in place of GPUs.

The H200 figures of docs/results/gpu-fast.md need a GPU; what they depend on in Switchyard's
own code is the CPU each process spends per streamed token. This drives the control
plane from C++ simulator workers at a GPU's token rate and stream count (by default
1000 streams at 30,000 tokens/s, as a 1B model gives on an H200), and reports, for
every process, CPU milliseconds per 1000 tokens, side by side in one run:

    python -m bench.cpu.proxy                         # worker direct, control plane x1, x2
    python -m bench.cpu.proxy --streams 200 --rate 6000 --routers 1 2 4
    python -m bench.cpu.proxy --streams 1000 --rate 16000 --routers 1 \
        --listeners 1 16 1 16 --clients 2 --probe  # one process's accept: 1 against 16
    python -m bench.cpu.proxy --streams 200 --rate 6000 --routers 1 --intervals 1 4 16
    python -m bench.cpu.proxy --streams 1000 --rate 16000 --routers 1 --fronts python native

A change that adds per-token work shows as a larger figure for the control plane. The
token rate a small machine reaches is printed too: when the control plane cannot keep
up, tokens coalesce into fewer messages (tokens/message goes above 1), which lowers the
cost per token, so compare runs at the same achieved rate. This is a benchmark, not a
test: it prints figures and asserts nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench import systems
from bench.load.loadgen import Workload
from bench.load.procload import processes_for, spread_load, start_delay_s
from control.fleet.local_workers import free_port
from switchyard_common.tinymodel import ensure_tiny_model


class Probe:
    """While a load runs: a one-token request on a fresh connection every `every_s`, and
    its time to first token. It is what a new caller waits behind the load, where a
    process that is slow to accept new calls shows (control/server.py, listeners)."""

    def __init__(self, address: str, model: str, delay_s: float, every_s: float = 0.05) -> None:
        self.address, self.model = address, model
        self.delay_s, self.every_s = delay_s, every_s
        self.ttft_ms: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Probe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)

    def _run(self) -> None:
        import grpc
        from switchyard.v1 import generation_pb2, generation_pb2_grpc

        if self._stop.wait(self.delay_s):  # the load's clients start sending then
            return
        i = 0
        while not self._stop.is_set():
            i += 1
            options = [("grpc.use_local_subchannel_pool", 1)]  # a connection of its own
            with grpc.insecure_channel(self.address, options=options) as ch:
                grpc.channel_ready_future(ch).result(timeout=30)
                req = generation_pb2.GenerateRequest(model=self.model)
                req.token_ids.ids.extend([7 + i % 300] * 16)
                req.stopping.max_tokens = 1
                sent = time.perf_counter()
                with contextlib.suppress(grpc.RpcError):
                    for msg in generation_pb2_grpc.GenerationStub(ch).Generate(req, timeout=60):
                        if msg.HasField("chunk"):
                            self.ttft_ms.append((time.perf_counter() - sent) * 1000)
                            break
            self._stop.wait(self.every_s)

    def summary(self) -> dict[str, float]:
        values = sorted(self.ttft_ms)
        if not values:
            return {}
        return {
            "p50": round(values[len(values) // 2], 1),
            "p99": round(values[min(len(values) - 1, round(0.99 * (len(values) - 1)))], 1),
            "samples": len(values),
        }


def measure(
    label: str,
    target: str,
    address: str,
    model: str,
    work: Workload,
    args: argparse.Namespace,
    groups: dict[str, list[int]],
    workers: list[str] | None = None,
) -> dict[str, Any]:
    before = {name: systems.cpu_seconds(pids) for name, pids in groups.items()}
    started = time.monotonic()
    processes = args.clients or processes_for(args.rate, args.streams)
    probing = args.probe and target == "switchyard"
    probe = Probe(address, model, start_delay_s(processes) + 0.5)
    split: dict[str, Any] = {}
    with (
        probe if probing else contextlib.nullcontext(probe),
        systems.engine_batches(workers or [], split),
    ):
        run = spread_load(
            target,
            address,
            model,
            work,
            args.streams,
            processes=processes,
            connections=args.connections,
        )
    wall = time.monotonic() - started
    tokens = max(1, run["tokens"])
    cpu = {name: systems.cpu_seconds(pids) - before[name] for name, pids in groups.items()}
    return {
        "system": label,
        "tokens_per_s": round(run["tokens_per_s"]),
        "tokens_per_message": round(tokens / max(1, run["messages"]), 2),
        "errors": run["errors"],
        "first_errors": run["first_errors"],
        "ttft_p50_ms": round(run["ttft_ms"].get("p50", 0.0), 1),
        "ttft_p99_ms": round(run["ttft_ms"].get("p99", 0.0), 1),
        "probe_ttft_ms": probe.summary(),
        "cpu_ms_per_1k_tokens": {k: round(v * 1e6 / tokens, 1) for k, v in cpu.items()},
        "cores_busy": {k: round(v / wall, 2) for k, v in cpu.items()},
        "client_processes": run["client_processes"],
        "client_busy": run["client_busy"],
        # Each worker's running requests over the run: how evenly the fronts split them.
        "workers_running_mean": [
            v.get("running_mean", 0) for v in split.get("engine", {}).values()
        ],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    ensure_tiny_model()
    step_us = max(1, round(args.streams / args.workers / (args.rate / args.workers) * 1e6))
    work = Workload(
        requests=args.streams * args.rounds,
        prompt_len=(args.prompt, args.prompt),
        output_len=(args.output, args.output),
        vocab=(4, 500),
    )
    results: list[dict[str, Any]] = []
    log_dir = Path(tempfile.mkdtemp(prefix="switchyard-cpu-proxy-"))
    with systems.sim_worker_procs(args.workers, log_dir, step_us=step_us) as procs:
        sims = [p.address for p in procs]
        sim_pids = [p.popen.pid for p in procs]
        if args.workers == 1:
            results.append(
                measure(
                    "worker (GenerateStream)",
                    "worker-stream",
                    sims[0],
                    "",
                    work,
                    args,
                    {"workers": sim_pids},
                )
            )
        model_yaml = (
            "  - name: sim\n    engine: sim\n    model: builtin:tiny\n"
            f"    workers: [{', '.join(sims)}]\n"
            "    limits: {max_concurrency: 100000, max_queue: 100000}\n"
        )
        runs: list[tuple[int, int, Path | None, int, str]] = [
            (r, n, None, i, f)
            for f in args.fronts
            for r in args.routers
            for n in args.listeners
            for i in args.intervals
        ]
        if args.before:  # the other checkout, with the same router counts
            runs += [(r, 0, args.before, 1, "python") for r in args.routers]
        for routers, listeners, cwd, interval, front in runs:
            name = f"control-x{routers}-l{listeners}-i{interval}-{front}"
            name += "-before" if cwd else ""
            label = f"control plane, {routers} process{'es' if routers > 1 else ''}"
            if cwd:
                label += ", before"
            if front == "native":
                label += ", native front"
            elif listeners:
                label += f", {listeners} listener{'s' if listeners > 1 else ''}"
            # an older checkout may not know api.front: it serves with grpc.aio as it is
            api = [f"front: {front}"] if cwd is None else []
            if interval > 1:  # the server's floor, so every stream gets it
                label += f", stream_interval {interval}"
                api.append(f"stream_interval: {interval}")
            settings = f"api: {{{', '.join(api)}}}\n" if api else ""
            with systems.control_plane(
                model_yaml, log_dir, name, routers, cwd, listeners, settings
            ) as (cp, proc):
                pids = [proc.popen.pid, *systems.descendants(proc.popen.pid)]
                results.append(
                    measure(
                        label + (f", from {cwd}" if cwd else ""),
                        "switchyard",
                        cp,
                        "sim",
                        work,
                        args,
                        {"control plane": pids, "workers": sim_pids},
                        sims if args.workers > 1 else None,
                    )
                )
    if args.vllm_streams:
        trees: list[Path | None] = [None, *([args.before] if args.before else [])]
        for cwd in trees:
            results.append(vllm_worker(args, log_dir, cwd))
    return {
        "command": "python -m bench.cpu.proxy " + " ".join(args.argv),
        "streams": args.streams,
        "target_tokens_per_s": args.rate,
        "sim_step_us": step_us,
        "prompt": args.prompt,
        "output": args.output,
        "cpus": os.cpu_count(),
        "results": results,
    }


def vllm_worker(args: argparse.Namespace, log_dir: Path, cwd: Path | None) -> dict[str, Any]:
    """The vLLM worker on the tiny model (vLLM on the CPU, so far slower than a GPU),
    called over GenerateStream: its own process's CPU per token, apart from the engine
    core's (which the engine spends whatever the front)."""
    model = ensure_tiny_model()
    port = free_port()
    settings = {"max_num_seqs": max(16, args.vllm_streams), "max_model_len": 2048}
    argv = [
        sys.executable, "-m", "pyworker", "--model", str(model), "--port", str(port),
        "--engine-args", json.dumps(settings),
    ]  # fmt: skip
    name = "pyworker" + ("-before" if cwd else "")
    proc = systems.start(name, argv, log_dir, f"127.0.0.1:{port}", cwd=cwd)
    try:
        systems.wait_grpc_serving(proc, proc.address)
        work = Workload(
            requests=args.vllm_streams * args.rounds,
            prompt_len=(args.prompt, args.prompt),
            output_len=(args.output, args.output),
            vocab=(4, 500),
        )
        warm = Workload(requests=args.vllm_streams, prompt_len=(16, 16), output_len=(16, 16))
        spread_load("worker-stream", proc.address, "", warm, args.vllm_streams, processes=1)
        groups = {
            "workers": [proc.popen.pid],
            "engine core": systems.descendants(proc.popen.pid),
        }
        label = "vLLM worker on the CPU (GenerateStream)" + (f", from {cwd}" if cwd else "")
        streams = argparse.Namespace(**{**vars(args), "streams": args.vllm_streams, "clients": 1})
        return measure(label, "worker-stream", proc.address, "", work, streams, groups)
    finally:
        proc.stop()


def print_table(data: dict[str, Any]) -> None:
    print(
        f"{data['streams']} streams, target {data['target_tokens_per_s']:,.0f} tokens/s "
        f"(simulator step {data['sim_step_us']} us), {data['prompt']} prompt / "
        f"{data['output']} output tokens, {data['cpus']} CPUs"
    )
    head = (
        "system", "tokens/s", "TTFT p50 / p99 ms", "tok/msg", "CP ms/1k tok", "CP cores",
        "worker ms/1k", "clients",
    )  # fmt: skip
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in data["results"]:
        cpu, cores = r["cpu_ms_per_1k_tokens"], r["cores_busy"]
        print(
            f"| {r['system']} | {r['tokens_per_s']:,} | "
            f"{r['ttft_p50_ms']:,.0f} / {r['ttft_p99_ms']:,.0f} | {r['tokens_per_message']} | "
            f"{cpu.get('control plane', '-')} | {cores.get('control plane', '-')} | "
            f"{cpu['workers']} | {r['client_processes']} (busy {max(r['client_busy'])}) |"
        )
        if r["errors"]:
            print(f"  errors: {r['errors']}: {r['first_errors']}")
        if r.get("workers_running_mean"):
            split = " / ".join(f"{x:g}" for x in r["workers_running_mean"])
            print(f"  each worker's running requests, mean over the run: {split}")
        if r.get("probe_ttft_ms"):
            p = r["probe_ttft_ms"]
            print(
                f"  a new request on its own connection, during the load: TTFT p50 "
                f"{p['p50']:,.0f} ms, p99 {p['p99']:,.0f} ms ({p['samples']} probes)"
            )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=1000, help="concurrent streams")
    p.add_argument("--rate", type=float, default=30000.0, help="tokens/s the workers make")
    p.add_argument("--workers", type=int, default=1, help="simulator workers")
    p.add_argument("--routers", type=int, nargs="+", default=[1, 2])
    p.add_argument(
        "--listeners",
        type=int,
        nargs="+",
        default=[0],
        help="gRPC listeners per control-plane process, each tried (0: its default)",
    )
    p.add_argument(
        "--intervals",
        type=int,
        nargs="+",
        default=[1],
        help="api.stream_interval of the control plane, each tried (tokens per chunk)",
    )
    p.add_argument(
        "--fronts",
        nargs="+",
        default=["python"],
        choices=["python", "native"],
        help="api.front of the control plane, each tried (native: the grpc++ front)",
    )
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--output", type=int, default=256)
    p.add_argument("--rounds", type=int, default=2, help="requests per stream")
    p.add_argument("--clients", type=int, default=0, help="client processes (default: auto)")
    p.add_argument("--connections", type=int, default=8, help="channels per client process")
    p.add_argument("--json", type=Path, help="also write the figures here")
    p.add_argument(
        "--probe",
        action="store_true",
        help="during each control-plane run, time a one-token request on a fresh "
        "connection every 50 ms (how long a new caller waits behind the load)",
    )
    p.add_argument(
        "--vllm-streams",
        type=int,
        default=0,
        help="also drive the vLLM worker (tiny model, vLLM on the CPU) with this many streams",
    )
    p.add_argument(
        "--before",
        type=Path,
        help="also run the control plane of another checkout (its control, pyworker and "
        "switchyard_common), for a before-and-after comparison in one run",
    )
    args = p.parse_args(argv)
    args.argv = argv if argv is not None else sys.argv[1:]
    data = run(args)
    print_table(data)
    if args.json:
        args.json.write_text(json.dumps(data, indent=1))


if __name__ == "__main__":
    main()
