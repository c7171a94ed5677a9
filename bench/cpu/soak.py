"""A soak: mixed traffic for a long time through one control plane, on real vLLM workers
and on C++ simulator workers at once, with random cancels and deadlines, changing
concurrency, constrained streams (structured output of every kind) among the vLLM
traffic, and one worker killed (SIGKILL) every few minutes.

    python -m bench.cpu.soak --minutes 20    # docs/results/soak.md, results/soak/soak.json.xz

It reports the RSS of every process over time, requests started and finished, streams
that ended without exactly one final or one status (must be zero), constrained outputs
that break their constraint, resumed after a kill or not (must be zero; each is judged
by its tokens and its text, bench/constraints.py), and what is still in flight at the
end, on the control plane and on every worker (must be zero). Loopback only; every loop
stops by itself at the end of the run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import structlog
from switchyard.v1 import admin_pb2, admin_pb2_grpc, common_pb2, generation_pb2, generation_pb2_grpc
from switchyard.worker.v1 import worker_pb2, worker_pb2_grpc

from bench.cpu.constraints import CASES, Case, Checker
from bench.results import PAGES, RAW, commit, relative, write_json
from bench.systems import control_plane, descendants
from switchyard_common.logs import configure_logging
from switchyard_common.tinymodel import ensure_tiny_model

log = structlog.get_logger("soak")
WORDS = "the quick brown fox jumps over a lazy dog while trains 🚂 switch yards at night".split()


def models_yaml(vllm_replicas: int, sim_replicas: int) -> str:
    out = ""
    if vllm_replicas:
        out += (
            "  - name: tiny\n    engine: vllm\n    model: builtin:tiny\n"
            f"    replicas: {vllm_replicas}\n"
            "    limits: {max_concurrency: 64, max_queue: 64}\n"
            "    health: {canary_interval_s: 2, canary_timeout_s: 5, failure_threshold: 3}\n"
        )
    if sim_replicas:
        out += (
            "  - name: sim\n    engine: sim\n    model: builtin:tiny\n"
            f"    replicas: {sim_replicas}\n"
            "    limits: {max_concurrency: 256, max_queue: 256}\n"
            "    engine_args: {max_context: 2048, decode_step_us: 1000}\n"
            "    health: {canary_interval_s: 2, canary_timeout_s: 2, failure_threshold: 3}\n"
        )
    return out


@dataclass
class Tally:
    started: Counter[str] = field(default_factory=Counter)
    outcomes: Counter[str] = field(default_factory=Counter)
    bad: list[str] = field(default_factory=list)  # streams that broke the contract
    late: Counter[str] = field(default_factory=Counter)  # final, then the client's deadline
    constrained: Counter[str] = field(default_factory=Counter)  # judged outputs, by kind
    resumed_constrained: Counter[str] = field(default_factory=Counter)  # of them, resumed
    broken: list[str] = field(default_factory=list)  # outputs that break their constraint

    def finished(self) -> int:
        return sum(self.outcomes.values())


CONSTRAINED_SHARE = 0.2  # of the vLLM model's requests


def random_request(
    rng: random.Random, model: str
) -> tuple[Any, float | None, int | None, Case | None]:
    words = rng.choices(WORDS, k=rng.randint(1, 60))
    req = generation_pb2.GenerateRequest(model=model, text=" ".join(words))
    if model == "tiny" and rng.random() < CONSTRAINED_SHARE:
        # Structured output, long enough for a kill to land inside; no stop strings (a
        # stop string would cut the output short of its constraint by the caller's wish).
        case = rng.choice(CASES)
        req.constraint.CopyFrom(case.to_proto())
        req.stopping.max_tokens = 160
        req.sampling.temperature = 1.0
        req.sampling.seed = rng.randint(0, 1000)
        timeout = rng.choice([None, None, None, 5.0])
        return req, timeout, rng.choice([None, None, None, 5]), case
    req.stopping.max_tokens = rng.choice([1, 4, 16, 32, 64, 128])
    if rng.random() < 0.3:
        req.stopping.stop.extend(rng.sample(WORDS, 2))
    if rng.random() < 0.5:
        req.sampling.temperature = rng.choice([0.0, 0.7, 1.0])
    if rng.random() < 0.3:
        req.sampling.seed = rng.randint(0, 1000)
    req.stopping.ignore_eos = rng.random() < 0.5
    timeout = rng.choice([None, None, None, 0.05, 0.5, 5.0])
    cancel_after = rng.choice([None, None, None, 0, 1, 5])
    return req, timeout, cancel_after, None


async def one(
    stub: Any, rng: random.Random, model: str, tally: Tally, checker: Checker | None
) -> None:
    req, timeout, cancel_after, case = random_request(rng, model)
    tally.started[model] += 1
    call = stub.Generate(req, timeout=timeout if timeout is not None else 120)
    finals = 0
    messages = 0
    ids: list[int] = []
    text = ""
    final: Any = None
    try:
        async for message in call:
            messages += 1
            if message.HasField("final"):
                finals += 1
                final = message.final
            elif finals:
                tally.bad.append(f"{model}: a chunk after the final")
            else:
                ids.extend(message.chunk.token_ids)
                text += message.chunk.text
            if cancel_after is not None and messages > cancel_after and not finals:
                call.cancel()
                tally.outcomes["cancelled by the client"] += 1
                return
    except grpc.aio.AioRpcError as err:
        if finals and err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            # The final arrived, then the client's own deadline fired before the OK
            # trailer: the server finished too close to the deadline.
            tally.late[f"{model}, deadline {timeout} s"] += 1
            tally.outcomes["final, then the client's deadline"] += 1
            return
        if finals:
            tally.bad.append(f"{model}: a status after the final: {err.code().name}")
        if err.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
            tally.bad.append(f"{model}: {err.code().name}: {err.details()}")
        tally.outcomes[err.code().name] += 1
        return
    if finals != 1:
        tally.bad.append(f"{model}: {finals} finals in a stream that ended OK")
    tally.outcomes["OK"] += 1
    if case is not None and checker is not None and final is not None:
        judge(case, ids, text, final, tally, checker)


def judge(
    case: Case, ids: list[int], text: str, final: Any, tally: Tally, checker: Checker
) -> None:
    """Count a constrained output, and any way it breaks its constraint (a stream cut
    short by max_tokens or its deadline owes a valid start only)."""
    stopped = final.finish_reason == common_pb2.FINISH_REASON_STOP
    tally.constrained[case.kind] += 1
    if final.resumed_after_tokens:
        tally.resumed_constrained[case.kind] += 1
    why = checker.violation(case, text, ids, stopped)
    if why is not None:
        tally.broken.append(
            f"{case.kind} (resumed after {list(final.resumed_after_tokens)}): {why}"
        )


async def client(stub: Any, seed: int, model: str, until: float, slots: asyncio.Semaphore,
                 tally: Tally, checker: Checker | None) -> None:  # fmt: skip
    rng = random.Random(seed)
    while time.monotonic() < until:
        async with slots:
            await one(stub, rng, model, tally, checker)


def rss_mb(pid: int) -> float:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def process_name(pid: int) -> str:
    with contextlib.suppress(OSError):
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        text = " ".join(c.decode(errors="replace") for c in cmd if c)
        if "switchyard-cpp-worker" in text:
            return f"sim worker :{text.rpartition('--port ')[2].split()[0]}"
        if "-m pyworker" in text:
            return f"vLLM worker :{text.rpartition('--port ')[2].split()[0]}"
        if "-m control" in text:
            return "control plane"
        return Path(cmd[0].decode()).name or "?"
    return "?"


async def sample_rss(root_pid: int, until: float, samples: list[dict[str, Any]]) -> None:
    started = time.monotonic()
    while time.monotonic() < until:
        pids = [root_pid, *descendants(root_pid)]
        per: dict[str, float] = {}
        for pid in pids:
            name = process_name(pid)
            if name.startswith(("sim", "vLLM", "control")):
                per[name] = per.get(name, 0.0) + rss_mb(pid)
            elif name.startswith(("python", "VLLM")):  # the vLLM engine core and helpers
                per["vLLM engine processes"] = per.get("vLLM engine processes", 0.0) + rss_mb(pid)
        samples.append({"t_s": round(time.monotonic() - started, 1), "rss_mb": per})
        await asyncio.sleep(5)


async def killer(admin: Any, every_s: float, until: float, kills: list[dict[str, Any]]) -> None:
    """SIGKILL one local worker every `every_s` seconds, alternating between models."""
    turn = 0
    while time.monotonic() + every_s < until:
        await asyncio.sleep(every_s)
        listed = await admin.ListWorkers(admin_pb2.ListWorkersRequest(), timeout=10)
        models = sorted({w.model for w in listed.workers})
        model = models[turn % len(models)]
        turn += 1
        victims = [w for w in listed.workers if w.model == model and w.local and w.serving]
        if not victims:
            continue
        victim = random.choice(victims)
        pid = listening_pid(victim.address)
        if pid is None:
            continue
        for doomed in [pid, *descendants(pid)]:  # the whole worker, engine processes too
            with contextlib.suppress(ProcessLookupError):
                os.kill(doomed, signal.SIGKILL)
        kills.append({"t": time.strftime("%H:%M:%S"), "model": model, "worker": victim.address})
        log.info("killed a worker", model=model, worker=victim.address, pid=pid)


def listening_pid(address: str) -> int | None:
    port = address.rpartition(":")[2]
    for proc in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            args = proc.read_bytes().split(b"\0")
            if b"--port" in args and args[args.index(b"--port") + 1] == port.encode():
                return int(proc.parent.name)
    return None


async def in_flight_at_end(address: str, within_s: float = 60) -> dict[str, int]:
    """Wait (bounded) until nothing is in flight; return what is left per process."""
    async with grpc.aio.insecure_channel(address) as channel:
        admin = admin_pb2_grpc.AdminStub(channel)
        deadline = time.monotonic() + within_s
        while True:
            listed = await admin.ListWorkers(admin_pb2.ListWorkersRequest(), timeout=10)
            left = {f"control plane -> {w.address}": w.in_flight for w in listed.workers}
            for w in listed.workers:
                left[f"worker {w.address}"] = await worker_in_flight(w.address)
            if not any(left.values()) or time.monotonic() > deadline:
                return left
            await asyncio.sleep(0.5)


async def worker_in_flight(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        try:
            call = stub.StreamLoad(worker_pb2.StreamLoadRequest(interval_ms=10), timeout=5)
            async for report in call:
                call.cancel()
                return int(report.in_flight) + int(report.running) + int(report.waiting)
        except grpc.aio.AioRpcError:
            return -1  # unreachable (restarting)
    return -1


async def soak(args: argparse.Namespace, address: str, pid: int) -> dict[str, Any]:
    tally = Tally()
    samples: list[dict[str, Any]] = []
    kills: list[dict[str, Any]] = []
    phases: list[dict[str, Any]] = []
    models = [m for m, n in (("tiny", args.vllm_replicas), ("sim", args.sim_replicas)) if n]
    levels = {"tiny": [2, 8, 16], "sim": [8, 32, 96]}
    end = time.monotonic() + args.minutes * 60
    # The vLLM workers run with vLLM's default, whitespace allowed in JSON.
    checker = Checker(ensure_tiny_model(), any_whitespace=True) if args.vllm_replicas else None
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        admin = admin_pb2_grpc.AdminStub(channel)
        background = [
            asyncio.create_task(sample_rss(pid, end, samples)),
            asyncio.create_task(killer(admin, args.kill_every_s, end, kills)),
        ]
        phase = 0
        while time.monotonic() < end:
            until = min(end, time.monotonic() + args.phase_s)
            conc = {m: levels[m][phase % len(levels[m])] for m in models}
            phases.append({"phase": phase, "concurrency": conc})
            log.info("phase", phase=phase, concurrency=conc, finished=tally.finished())
            tasks = []
            for m in models:
                slots = asyncio.Semaphore(conc[m])
                for i in range(conc[m]):
                    seed = phase * 1000 + i + (0 if m == "tiny" else 500)
                    tasks.append(
                        asyncio.create_task(client(stub, seed, m, until, slots, tally, checker))
                    )
            await asyncio.gather(*tasks)
            phase += 1
        await asyncio.gather(*background)
    left = await in_flight_at_end(address)
    return {
        "minutes": args.minutes,
        "started": dict(tally.started),
        "finished": tally.finished(),
        "outcomes": dict(tally.outcomes),
        "contract_violations": dict(Counter(tally.bad)),
        "contract_violation_count": len(tally.bad),
        "final_then_client_deadline": dict(tally.late),
        "constrained_outputs": dict(tally.constrained),
        "constrained_resumed": dict(tally.resumed_constrained),
        "constraint_violations": tally.broken,
        "in_flight_at_end": left,
        "kills": kills,
        "phases": phases,
        "rss": samples,
    }


def write_report(result: dict[str, Any], out_dir: Path, raw: Path) -> None:
    """The page (OUT_DIR/soak.md) and its plot; the raw figures to `raw`."""
    write_json(raw, result)
    out_dir.mkdir(parents=True, exist_ok=True)
    names = sorted({n for s in result["rss"] for n in s["rss_mb"]})
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(9, 4.5))
        for n in names:
            xs = [s["t_s"] / 60 for s in result["rss"] if n in s["rss_mb"]]
            ys = [s["rss_mb"][n] for s in result["rss"] if n in s["rss_mb"]]
            ax.plot(xs, ys, label=n)
        ax.set_xlabel("minutes")
        ax.set_ylabel("RSS (MiB)")
        ax.set_title("Soak: RSS of every process (worker restarts show as gaps)")
        ax.legend(fontsize=7, loc="upper left")
        fig.tight_layout()
        fig.savefig(out_dir / "soak-rss.png", dpi=110)
    except ImportError:
        log.warning("matplotlib is not installed; no plot (pip install -e '.[bench]')")
    first = result["rss"][0]["rss_mb"] if result["rss"] else {}
    last = result["rss"][-1]["rss_mb"] if result["rss"] else {}
    rows = "\n".join(
        f"| {n} | {first.get(n, float('nan')):.0f} | {last.get(n, float('nan')):.0f} |"
        for n in names
    )
    left = result["in_flight_at_end"]
    violations = result["contract_violation_count"]
    still = sum(v for v in left.values() if v > 0)
    late = result.get("final_then_client_deadline", {}) or 0
    constrained = result.get("constrained_outputs", {})
    resumed = result.get("constrained_resumed", {})
    broken = result.get("constraint_violations", [])
    text = f"""# Soak

`python -m bench.cpu.soak --minutes {result["minutes"]}` at commit {result.get("commit", "?")}:
{result["minutes"]} minutes through one
control plane on real vLLM (CPU) workers and C++ simulator workers at once: concurrency
changing every phase, random cancels (after 0, 1 or 5 messages) and deadlines (50 ms, 0.5 s,
5 s), stop strings and seeds, constrained streams of every kind (a fifth of the vLLM
traffic, each output judged by its tokens and its text), and one worker killed with
SIGKILL every few minutes (the supervisor restarts it; its streams fail over or resume).

| | |
|---|---|
| requests started | {sum(result["started"].values())} ({result["started"]}) |
| requests finished | {result["finished"]} |
| how they ended | {result["outcomes"]} |
| streams without exactly one final or one status, or INTERNAL/UNKNOWN | **{violations}** |
| streams whose final came, then the client's own deadline before the OK | {late} |
| constrained outputs judged, by kind (of them resumed after a kill) | {constrained} ({resumed}) |
| constrained outputs that break their constraint | **{len(broken)}** |
| in flight at the end (control plane and workers) | **{still}** ({left}) |
| workers killed | {len(result["kills"])} |

RSS in MiB, first and last sample (every 5 s; the plot has them all):

| process | first | last |
|---|---|---|
{rows}

![RSS over time](soak-rss.png)

Violations, by kind: {result["contract_violations"] or "none"}

Constrained outputs that broke their constraint: {broken or "none"}

Raw figures: `{relative(raw)}`.
"""
    (out_dir / "soak.md").write_text(text)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=20.0)
    p.add_argument("--vllm-replicas", type=int, default=2)
    p.add_argument("--sim-replicas", type=int, default=2)
    p.add_argument("--kill-every-s", type=float, default=180.0)
    p.add_argument("--phase-s", type=float, default=120.0)
    p.add_argument("--out", type=Path, default=PAGES, help="the page's folder (soak.md, PNG)")
    p.add_argument("--json", type=Path, default=RAW / "soak" / "soak.json.xz")
    args = p.parse_args(argv)
    configure_logging("console", "info")
    ensure_tiny_model()
    log_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"switchyard-soak-{os.getpid()}"
    log_dir.mkdir(parents=True, exist_ok=True)
    log.info("starting the control plane and its workers", logs=str(log_dir))
    yaml = models_yaml(args.vllm_replicas, args.sim_replicas)
    with control_plane(yaml, log_dir, name="soak-control") as (address, proc):
        result = asyncio.run(soak(args, address, proc.popen.pid))
    result["commit"] = commit()
    write_report(result, args.out, args.json)
    log.info(
        "soak done",
        finished=result["finished"],
        violations=result["contract_violation_count"],
        constraint_violations=len(result["constraint_violations"]),
        in_flight_at_end=result["in_flight_at_end"],
        report=str(args.out / "soak.md"),
    )


if __name__ == "__main__":
    main()
