"""The routing policies on real vLLM CPU workers with prefix caching: the tenants' traffic
of the fleet simulation, smaller, through the control plane; the hit rates are what the
engines report (each request's `usage.cached_prompt_tokens`, vLLM's num_cached_tokens).

    python -m bench.fleet.kv_routing --seeds 0 1 --routers 1 4 \
        --json results/kv-routing/real.json.xz
    python -m bench.fleet.kv_routing --policies kv_aware cache_aware prefix_affinity \
        --seeds 0 1 --restarts 1 --json results/kv-routing/real-restart.json.xz

The workers start once; each policy's run (per seed, number of routers and of restarts)
gets a fresh control plane in front of them. So that one run never hits blocks cached by
another's, each run maps the token ids through its own permutation: every prompt keeps
its shape (what it shares with which other prompt), but no block is the same as in
another run. Before each run every worker's cache is filled with prompts of its own,
called on the worker directly, so that every run starts from the same state: caches full
of blocks nothing will reuse. With `--restarts N` the control plane is replaced by a fresh
one N times during the run: the traffic is split into N + 1 parts, and each part's
requests all finish before its control plane is replaced (no request is in flight across
a restart). The workers keep what they cache.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
import structlog

from bench import systems
from bench.fleet.workload import TenantSpec, Workload, describe, make_workload, reuse_ceiling
from bench.results import write_json
from switchyard_common.logs import configure_logging
from switchyard_common.tinymodel import ensure_tiny_model

log = structlog.get_logger(__name__)

POLICIES = (
    "round_robin",
    "least_load",
    "power_of_two",
    "prefix_affinity",
    "kv_aware",
    "dynamo_cost",
    "cache_aware",
)
VOCAB = 500  # token ids 4..499: ordinary tokens of the tiny model
BLOCK_TOKENS = 128  # vLLM's CPU backend
# vLLM's CPU backend: 128-token blocks. A worker's cache is kept small (num_gpu_blocks_override,
# `--cache-blocks`) so that it holds a share of the conversations, not all of them: with 96
# (or 40) blocks each of 3 workers held everything 6 tenants' traffic reuses, and the
# cache-aware policies all came within 2% of the same hit rate.
CACHE_BLOCKS = 32
CHANNELS = 16
SPEC = TenantSpec(
    requests=150,
    rate=3.0,
    tenants=12,
    system_tokens=(384, 1024),
    turns=(1, 4),
    user_tokens=(32, 128),
    output_tokens=(8, 24),
    think_s=2.0,
    answer_s_per_token=0.02,
    unique_share=0.15,
    unique_tokens=(256, 768),
    max_prompt_tokens=1900,
)


@dataclass(frozen=True, slots=True)
class RealResult:
    policy: str
    seed: int  # the traffic's
    routers: int  # control-plane processes (serve --routers)
    restarts: int  # times the control plane was replaced by a fresh one during the run
    requests: int
    completed: int
    errors: int
    prompt_tokens: int
    cached_prompt_tokens: int
    engine_hit_rate: float  # cached / prompt tokens, as the engines reported them
    ttft_p50_ms: float
    ttft_p99_ms: float
    output_tok_s: float
    request_share: dict[str, float]  # each worker's share of the requests it served
    # Per request, by index: (worker, prompt tokens, cached prompt tokens, TTFT ms or None)
    trace: list[tuple[str, int, int, float | None]]
    # CPU seconds while the traffic ran: the control plane's processes (its routers), and
    # the workers' (with vLLM's engine processes)
    control_cpu_s: float = 0.0
    workers_cpu_s: float = 0.0


def permuted(workload: Workload, seed: int) -> list[list[int]]:
    """Every prompt, with token ids mapped through one permutation of the vocabulary."""
    ids = list(range(4, VOCAB))
    shuffled = ids[:]
    random.Random(seed).shuffle(shuffled)
    table = dict(zip(ids, shuffled, strict=True))
    return [[table[t] for t in workload.prompt(k)] for k in range(workload.requests)]


@dataclass(slots=True)
class Tally:
    """What a policy's run has seen so far, over one control plane or several in turn."""

    requests: int
    ttft: list[float] = field(default_factory=list)
    # Per request, by index: (worker, prompt tokens, cached prompt tokens, TTFT ms); TTFT
    # None for a request that never finished
    trace: list[tuple[str, int, int, float | None]] = field(init=False)
    prompt_tokens: int = 0
    cached: int = 0
    tokens: int = 0
    errors: int = 0
    sending_s: float = 0.0  # wall time spent sending, restarts excluded
    control_cpu_s: float = 0.0  # while sending
    workers_cpu_s: float = 0.0

    def __post_init__(self) -> None:
        self.trace = [("", 0, 0, None)] * self.requests

    def result(self, policy: str, seed: int, routers: int, restarts: int) -> RealResult:
        ttft = self.ttft
        q = statistics.quantiles(ttft, n=100, method="inclusive") if len(ttft) > 1 else [0.0] * 99
        served = Counter(w for w, *_ in self.trace if w)
        return RealResult(
            policy=policy,
            seed=seed,
            routers=routers,
            restarts=restarts,
            requests=self.requests,
            completed=len(ttft),
            errors=self.errors,
            prompt_tokens=self.prompt_tokens,
            cached_prompt_tokens=self.cached,
            engine_hit_rate=self.cached / self.prompt_tokens if self.prompt_tokens else 0.0,
            ttft_p50_ms=q[49],
            ttft_p99_ms=q[98],
            output_tok_s=self.tokens / self.sending_s if self.sending_s else 0.0,
            request_share={
                w: round(n / max(1, sum(served.values())), 3) for w, n in sorted(served.items())
            },
            trace=self.trace,
            control_cpu_s=round(self.control_cpu_s, 2),
            workers_cpu_s=round(self.workers_cpu_s, 2),
        )


async def send(
    address: str,
    workload: Workload,
    prompts: list[list[int]],
    indices: range,
    lanes: Sequence[int],
    into: Tally,
) -> None:
    """Requests `indices` through the control plane at `address`, at their arrival times
    (counted from the first one's), each on connection `lanes[k]` of CHANNELS."""
    from switchyard.v1 import generation_pb2 as pb
    from switchyard.v1 import generation_pb2_grpc

    t0 = workload.arrival_us[indices[0]] / 1e6 if indices else 0.0
    started = time.perf_counter()

    async with contextlib.AsyncExitStack() as stack:
        stubs = []
        for _ in range(CHANNELS):
            own = [("grpc.use_local_subchannel_pool", 1)]  # a connection of its own
            channel = await stack.enter_async_context(grpc.aio.insecure_channel(address, own))
            stubs.append(generation_pb2_grpc.GenerationStub(channel))

        async def one(k: int) -> None:
            due = workload.arrival_us[k] / 1e6 - t0 - (time.perf_counter() - started)
            await asyncio.sleep(max(0.0, due))
            req = pb.GenerateRequest(
                model="tiny",
                token_ids=pb.TokenIds(ids=prompts[k]),
                stopping=pb.StoppingParams(max_tokens=workload.max_tokens[k], ignore_eos=True),
            )
            sent = time.perf_counter()
            first: float | None = None
            try:
                async for msg in stubs[lanes[k]].Generate(req, timeout=600):
                    if first is None:
                        first = time.perf_counter() - sent
                    if msg.HasField("chunk"):
                        into.tokens += len(msg.chunk.token_ids)
                    if msg.HasField("final"):
                        usage = msg.final.usage
                        into.prompt_tokens += usage.prompt_tokens
                        into.cached += usage.cached_prompt_tokens
                        ms = (first or 0.0) * 1000
                        into.trace[k] = (
                            msg.final.worker,
                            usage.prompt_tokens,
                            usage.cached_prompt_tokens,
                            ms,
                        )
            except grpc.aio.AioRpcError as e:
                into.errors += 1
                log.warning("request failed", request=k, code=e.code().name)
                return
            if first is not None:
                into.ttft.append(first * 1000)

        await asyncio.gather(*(one(k) for k in indices))
    into.sending_s += time.perf_counter() - started


async def fill_caches(addresses: Sequence[str], blocks: int, seed: int) -> None:
    """Each worker's cache filled with `blocks` blocks of random tokens (and a few more),
    one prompt after another on the worker directly."""
    from switchyard.worker.v1 import worker_pb2, worker_pb2_grpc

    rng = random.Random(seed)
    per_prompt = 8 * BLOCK_TOKENS
    for address in addresses:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            for i in range(blocks // 8 + 2):
                req = worker_pb2.GenerateRequest(
                    request_id=f"fill-{seed}-{i}",
                    prompt_token_ids=[rng.randrange(4, VOCAB) for _ in range(per_prompt)],
                    max_tokens=1,
                    ignore_eos=True,
                )
                async for _ in stub.Generate(req, timeout=120):
                    pass


def model_yaml(model: Path, workers: Sequence[str], policy: str, kv_aware: dict[str, float]) -> str:
    weights = f"    kv_aware: {json.dumps(kv_aware)}\n" if kv_aware and policy == "kv_aware" else ""
    return (
        f"  - name: tiny\n    engine: vllm\n    model: {model}\n"
        f"    workers: [{', '.join(workers)}]\n    routing: {policy}\n{weights}"
        f"    limits: {{max_concurrency: 4096, max_queue: 4096}}\n"
    )


def markdown(results: Sequence[RealResult]) -> str:
    lines = [
        "| routers | seed | policy | engine-reported hit rate | cached / prompt tokens | "
        "TTFT p50 ms | TTFT p99 ms | output tok/s | completed | CPU s, control / workers |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.routers} | {r.seed} | {r.policy} | {r.engine_hit_rate:.1%} | "
            f"{r.cached_prompt_tokens:,} / {r.prompt_tokens:,} | {r.ttft_p50_ms:,.0f} | "
            f"{r.ttft_p99_ms:,.0f} | {r.output_tok_s:,.1f} | {r.completed}/{r.requests} | "
            f"{r.control_cpu_s:.1f} / {r.workers_cpu_s:.1f} |"
        )
    return "\n".join(lines)


def run_one(
    model_yaml: str,
    workers: Sequence[systems.Running],
    logs: Path,
    workload: Workload,
    label: str,
    routers: int,
    restarts: int,
    run: int,
    cache_blocks: int,
) -> RealResult:
    """One policy's run: its own token permutation, every cache filled first, then the
    traffic through a fresh control plane, replaced `restarts` times on the way (the
    workers, and what their caches hold, stay)."""
    seed = workload.spec.seed * 1000 + run
    prompts = permuted(workload, seed)
    asyncio.run(fill_caches([w.address for w in workers], cache_blocks, seed))
    # Each request on one of CHANNELS connections, drawn at random: callers are many
    # services, and with `--routers N` the kernel spreads connections across the routers.
    draw = random.Random(seed)
    lanes = [draw.randrange(CHANNELS) for _ in range(workload.requests)]
    tally = Tally(workload.requests)
    n = workload.requests
    bounds = [n * j // (restarts + 1) for j in range(restarts + 2)]
    for j in range(restarts + 1):
        name = f"control-{run}-{label}-{j}"
        with systems.control_plane(model_yaml, logs, name=name, routers=routers) as (
            address,
            proc,
        ):
            part = range(bounds[j], bounds[j + 1])
            control = [proc.popen.pid, *systems.descendants(proc.popen.pid)]
            engines = [p for w in workers for p in (w.pid, *systems.descendants(w.pid))]
            before = systems.cpu_seconds(control), systems.cpu_seconds(engines)
            asyncio.run(send(address, workload, prompts, part, lanes, tally))
            tally.control_cpu_s += systems.cpu_seconds(control) - before[0]
            tally.workers_cpu_s += systems.cpu_seconds(engines) - before[1]
    return tally.result(label, workload.spec.seed, routers, restarts)


def variant(text: str) -> tuple[str, dict[str, float]]:
    """`LABEL=JSON`: a kv_aware run with those weights."""
    label, sep, weights = text.partition("=")
    if not sep or not label:
        raise argparse.ArgumentTypeError(f"expected LABEL=JSON, got {text!r}")
    try:
        parsed = json.loads(weights)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{label}: weights are not JSON: {e}") from e
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"{label}: weights must be a JSON object")
    return label, parsed


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser("python -m bench.fleet.kv_routing", description=__doc__)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--requests", type=int, default=SPEC.requests)
    ap.add_argument("--rate", type=float, default=SPEC.rate, help="arrivals per second")
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0], help="the traffic's, in turn")
    ap.add_argument(
        "--routers",
        type=int,
        nargs="+",
        default=[1],
        help="control-plane processes (serve --routers), in turn",
    )
    ap.add_argument(
        "--restarts",
        type=int,
        nargs="+",
        default=[0],
        help="times the control plane is replaced by a fresh one during a run (the traffic "
        "split evenly), in turn",
    )
    ap.add_argument(
        "--cache-blocks", type=int, default=CACHE_BLOCKS, help="KV blocks of 128 tokens a worker"
    )
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument(
        "--kv-aware",
        type=json.loads,
        default={},
        help='kv_aware\'s weights, e.g. {"load_weight": 0.1}',
    )
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        type=variant,
        metavar="LABEL=JSON",
        help="also run kv_aware with these weights, reported as LABEL: "
        "e0='{\"eviction_weight\": 0}'",
    )
    args = ap.parse_args(argv)
    configure_logging()
    specs = [
        TenantSpec(**{**asdict(SPEC), "requests": args.requests, "rate": args.rate, "seed": seed})
        for seed in args.seeds
    ]
    model = ensure_tiny_model()
    engine = {**systems.ENGINE_SETTINGS, "num_gpu_blocks_override": args.cache_blocks}
    results: list[RealResult] = []
    ceilings: dict[int, tuple[int, int]] = {}
    with tempfile.TemporaryDirectory(prefix="kv-routing-") as tmp, contextlib.ExitStack() as stack:
        logs = Path(tmp)
        workers = []
        for i in range(args.workers):
            log.info("starting vLLM worker", worker=i + 1, of=args.workers)
            workers.append(stack.enter_context(systems.pyworker(model, logs, engine)))
        addresses = [w.address for w in workers]
        runs = [(p, p, args.kv_aware) for p in args.policies] + [
            (label, "kv_aware", weights) for label, weights in args.variant
        ]
        run = 0  # every run's own token permutation and filler
        for spec in specs:
            workload = make_workload(spec, VOCAB)
            ceilings[spec.seed] = reuse_ceiling(workload, BLOCK_TOKENS)
            for routers, restarts, (label, policy, weights) in itertools.product(
                args.routers, args.restarts, runs
            ):
                run += 1
                yaml = model_yaml(model, addresses, policy, weights)
                log.info(
                    "running", policy=label, seed=spec.seed, routers=routers, restarts=restarts
                )
                r = run_one(
                    yaml,
                    workers,
                    logs,
                    workload,
                    label,
                    routers,
                    restarts,
                    run,
                    args.cache_blocks,
                )
                results.append(r)
                shares = " ".join(f"{s:.2f}" for s in r.request_share.values())
                print(
                    f"routers {routers} restarts {restarts} seed {spec.seed} {label:16s} "
                    f"hit {r.engine_hit_rate:6.1%}  TTFT p50 {r.ttft_p50_ms:7.0f} ms  "
                    f"p99 {r.ttft_p99_ms:7.0f} ms  {r.output_tok_s:6.1f} tok/s  "
                    f"{r.completed}/{r.requests}  requests by worker {shares}  CPU s: control "
                    f"{r.control_cpu_s:.1f}, workers {r.workers_cpu_s:.1f}",
                    flush=True,
                )
    print(markdown(results))
    for seed, (cached, total) in ceilings.items():
        print(f"seed {seed}: reuse ceiling (one cache that never evicts) {cached / total:.1%}")
    if args.json:
        data: dict[str, Any] = {
            "command": " ".join(
                ["python", "-m", "bench.fleet.kv_routing", *(argv or sys.argv[1:])]
            ),
            "workload": [describe(spec) for spec in specs],
            "workers": args.workers,
            "engine_args": engine,
            "reuse_ceiling": {
                str(seed): {"cached_prompt_tokens": c, "prompt_tokens": t}
                for seed, (c, t) in ceilings.items()
            },
            "results": [asdict(r) for r in results],
        }
        write_json(args.json, data)
    return 0 if all(r.completed == r.requests for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
