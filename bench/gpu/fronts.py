"""The 8B phases on one H200 (`bench.gpu --phase fronts|peers|quant`): vLLM's AsyncLLM in
the benchmark's own process (the ceiling for any front), `switchyard serve` with its vLLM
worker, the worker called directly and the control plane in front of it alternately, and
vLLM's OpenAI and gRPC servers; then fp8 weights and an fp8 KV cache through the control
plane.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from bench import systems
from bench.gpu import common
from bench.gpu.common import (
    asyncllm_argv,
    gpu_memory_sampler,
    list_workers,
    run_load,
    served_model,
    workload,
)
from bench.load.loadgen import make_target
from bench.load.probe import ttft_probe
from bench.load.procload import percentiles

log = structlog.get_logger(__name__)


def asyncllm_inprocess(
    model: Path, settings: dict[str, Any], loads: tuple[int, ...] = ()
) -> list[dict[str, Any]]:
    """vLLM's AsyncLLM in this process, DELTA streaming: the ceiling for any front."""
    argv = asyncllm_argv(model, settings, loads or common.LOADS)
    out = subprocess.run(argv, stdout=subprocess.PIPE, text=True, timeout=900, check=True)
    return [json.loads(line[7:]) for line in out.stdout.splitlines() if line.startswith("RESULT ")]


def run_asyncllm(
    model: str,
    settings: dict[str, Any],
    loads: tuple[int, ...],
    go: bool = False,
    reps: int = 2,
    waves: int = 1,
) -> None:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    from pyworker.engine import (
        LoadStats,
        make_stat_logger_factory,
        prepare_environment,
        token_prompt_factory,
    )

    prepare_environment(settings)
    make_prompt = token_prompt_factory()
    # The worker's own stat logger and settings (its scheduler counts, nothing else), so
    # the two engines do the same work per step and report the same batch counts.
    load = LoadStats()
    llm = AsyncLLM.from_vllm_config(
        AsyncEngineArgs(model=model, **settings).create_engine_config(),
        stat_loggers=[make_stat_logger_factory(load)],
        disable_log_stats=True,
    )

    async def one(i: int, prompt: list[int], n: int, seed: int) -> tuple[float | None, int]:
        params = SamplingParams(
            max_tokens=n, ignore_eos=True, output_kind=RequestOutputKind.DELTA, detokenize=False
        )
        start = time.perf_counter()
        ttft = None
        tokens = 0
        async for out in llm.generate(make_prompt(prompt), params, request_id=f"r{seed}-{i}"):
            if ttft is None:
                ttft = (time.perf_counter() - start) * 1000
            tokens += len(out.outputs[0].token_ids)
        return ttft, tokens

    async def run(requests: int, seed: int, waves: int = 1) -> dict[str, Any]:
        """`requests` at a time, `waves` times as many in all (closed loop)."""
        items = workload(requests * waves, seed).items()
        slots = asyncio.Semaphore(requests)

        async def slot(i: int, p: list[int], n: int) -> tuple[float | None, int]:
            async with slots:
                return await one(i, p, n, seed)

        seen: list[tuple[int, int, float]] = []

        async def watch() -> None:  # the engine's batch, as the worker's StreamLoad sees it
            while True:
                await asyncio.sleep(0.25)
                snap = load.snapshot()
                seen.append((snap.running, snap.waiting, 0.0))

        watcher = asyncio.get_running_loop().create_task(watch())
        start = time.perf_counter()
        got = await asyncio.gather(*(slot(i, p, n) for i, (p, n) in enumerate(items)))
        took = time.perf_counter() - start
        watcher.cancel()
        tokens = sum(t for _, t in got)
        return {
            "engine": {"in-process": systems.batch_summary(seen)},
            "system": "asyncllm",
            "requests": requests * waves,
            "concurrency": requests,
            "tokens": tokens,
            "seconds": took,
            "tokens_per_s": tokens / took,
            "errors": sum(1 for _, t in got if t != common.OUTPUT),
            "ttft_ms": percentiles([t for t, _ in got if t is not None]),
        }

    async def main() -> None:
        await run(32, seed=99)  # warm-up
        if go:  # started beside another engine: run when told, so the two never overlap
            print("READY", flush=True)
            await asyncio.to_thread(sys.stdin.readline)
        for load in loads:
            for _ in range(reps):
                print("RESULT " + json.dumps(await run(load, seed=1, waves=waves)), flush=True)

    asyncio.run(main())
    llm.shutdown()


def ttft_pairs(cp: str, worker: str, model: str) -> dict[str, Any]:
    """Single requests, alternating between the worker and the control plane in front
    (bench.cpu.compare's probe: distinct prompts, so neither hits the other's prefix cache)."""
    factories = [
        lambda: make_target("worker", worker, model),
        lambda: make_target("switchyard", cp, model),
    ]
    got = asyncio.run(ttft_probe(factories, common.TTFT_PAIRS, common.PROMPT))
    w, s = got["worker"], got["switchyard"]
    return {
        "pairs": int(w["samples"]),
        "worker_ms": w,
        "switchyard_ms": s,
        "overhead_ms": {k: s[k] - w[k] for k in ("p50", "p99")},
        "distinct_prompts": True,
    }


def switchyard_fronts(
    model: Path, out: Path, settings: dict[str, Any], label: str, full: bool
) -> dict[str, Any]:
    """`switchyard serve` starting its vLLM worker; the worker called directly and the
    control plane in front of it, alternately at each load."""
    result: dict[str, Any] = {"label": label, "settings": settings, "runs": []}
    log_dir = out / f"logs-{label}"
    log_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with systems.control_plane(served_model("m", model, settings), log_dir) as (cp, proc):
        result["start_s"] = time.monotonic() - started
        workers = list_workers(cp)
        result["workers_at_start"] = workers
        worker = workers[0]["address"]
        run_load("switchyard", cp, "m", 32, seed=99)  # warm-up
        for load in common.LOADS:
            # ABBA: neither goes first every time (later runs find more shapes compiled)
            pair = ["worker", "switchyard", "switchyard", "worker"] if full else ["switchyard"]
            for target in pair:
                address = worker if target == "worker" else cp
                if full and load == common.LOADS[0] and target == "switchyard":
                    with gpu_memory_sampler(out / f"gpu-memory-{label}.csv"):
                        run = run_load(target, address, "m", load, seed=1)
                        result["workers_under_load"] = list_workers(cp)
                else:
                    run = run_load(target, address, "m", load, seed=1)
                log.info(
                    "run",
                    label=label,
                    system=target,
                    requests=load,
                    tokens_per_s=round(run["tokens_per_s"]),
                    ttft_p50_ms=run["ttft_ms"].get("p50"),
                )
                result["runs"].append(run)
        if full:
            result["ttft_pairs"] = ttft_pairs(cp, worker, "m")
        result["log_tail"] = proc.log_tail(40)
    return result


def steps(phase: str, model: Path, out: Path) -> list[tuple[str, Callable[[], dict[str, Any]]]]:
    """The systems of `phase` (fronts, peers or quant), each a step that returns its result."""
    settings = common.SETTINGS
    if phase == "fronts":
        return [
            (
                "asyncllm",
                lambda: {"label": "asyncllm", "runs": asyncllm_inprocess(model, settings)},
            ),
            ("switchyard", lambda: switchyard_fronts(model, out, settings, "bf16", True)),
        ]
    if phase == "peers":
        return [
            ("openai", lambda: common.peer("openai", model, out, settings)),
            ("vllm-grpc", lambda: common.peer("vllm-grpc", model, out, settings)),
        ]
    fp8 = {**settings, "quantization": "fp8"}
    kv8 = {**settings, "kv_cache_dtype": "fp8"}
    return [
        ("fp8", lambda: switchyard_fronts(model, out, fp8, "fp8", False)),
        ("kv-fp8", lambda: switchyard_fronts(model, out, kv8, "kv-fp8", False)),
    ]
