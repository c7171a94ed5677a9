"""The routing policies on real vLLM CPU workers with prefix caching: the tenants' traffic
of the fleet simulation, smaller, through the control plane; the hit rates are what the
engines report (each request's `usage.cached_prompt_tokens`, vLLM's num_cached_tokens).

    python -m bench.kv_routing --workers 3 --requests 120 --json docs/kv-routing-real.json

The workers start once; each policy gets a fresh control plane in front of them. So that
one policy's run never hits blocks cached by another's, each run maps the token ids
through its own permutation: every prompt keeps its shape (what it shares with which
other prompt), but no block is the same as in another run. Before each run every
worker's cache is filled with prompts of its own, called on the worker directly, so that
every policy starts from the same state: caches full of blocks nothing will reuse.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc
import structlog

from bench import systems
from bench.fleet_workload import TenantSpec, Workload, describe, make_workload
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
    requests: int
    completed: int
    errors: int
    prompt_tokens: int
    cached_prompt_tokens: int
    engine_hit_rate: float  # cached / prompt tokens, as the engines reported them
    ttft_p50_ms: float
    ttft_p99_ms: float
    output_tok_s: float
    # Each worker's share of the requests in flight, sampled every 100 ms (ListWorkers)
    in_flight_share: dict[str, float]


def permuted(workload: Workload, seed: int) -> list[list[int]]:
    """Every prompt, with token ids mapped through one permutation of the vocabulary."""
    ids = list(range(4, VOCAB))
    shuffled = ids[:]
    random.Random(seed).shuffle(shuffled)
    table = dict(zip(ids, shuffled, strict=True))
    return [[table[t] for t in workload.prompt(k)] for k in range(workload.requests)]


async def run_policy(
    address: str, workload: Workload, prompts: list[list[int]], policy: str
) -> RealResult:
    from switchyard.v1 import generation_pb2 as pb
    from switchyard.v1 import generation_pb2_grpc

    ttft: list[float] = []
    in_flight: dict[str, float] = {}
    prompt_tokens = cached = tokens = errors = 0
    started = time.perf_counter()

    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)

        async def one(k: int) -> None:
            nonlocal prompt_tokens, cached, tokens, errors
            due = workload.arrival_us[k] / 1e6 - (time.perf_counter() - started)
            await asyncio.sleep(max(0.0, due))
            req = pb.GenerateRequest(
                model="tiny",
                token_ids=pb.TokenIds(ids=prompts[k]),
                stopping=pb.StoppingParams(max_tokens=workload.max_tokens[k], ignore_eos=True),
            )
            sent = time.perf_counter()
            first: float | None = None
            try:
                async for msg in stub.Generate(req, timeout=600):
                    if first is None:
                        first = time.perf_counter() - sent
                    if msg.HasField("chunk"):
                        tokens += len(msg.chunk.token_ids)
                    if msg.HasField("final"):
                        prompt_tokens += msg.final.usage.prompt_tokens
                        cached += msg.final.usage.cached_prompt_tokens
            except grpc.aio.AioRpcError as e:
                errors += 1
                log.warning("request failed", policy=policy, request=k, code=e.code().name)
                return
            if first is not None:
                ttft.append(first * 1000)

        sampler = asyncio.create_task(sample_in_flight(channel, in_flight))
        await asyncio.gather(*(one(k) for k in range(workload.requests)))
        sampler.cancel()
    wall = time.perf_counter() - started
    q = statistics.quantiles(ttft, n=100, method="inclusive") if len(ttft) > 1 else [0.0] * 99
    return RealResult(
        policy=policy,
        requests=workload.requests,
        completed=len(ttft),
        errors=errors,
        prompt_tokens=prompt_tokens,
        cached_prompt_tokens=cached,
        engine_hit_rate=cached / prompt_tokens if prompt_tokens else 0.0,
        ttft_p50_ms=q[49],
        ttft_p99_ms=q[98],
        output_tok_s=tokens / wall,
        in_flight_share={
            w: round(n / (sum(in_flight.values()) or 1), 3) for w, n in sorted(in_flight.items())
        },
    )


async def sample_in_flight(channel: grpc.aio.Channel, into: dict[str, float]) -> None:
    """Adds each worker's in-flight requests (this control plane's) every 100 ms."""
    from switchyard.v1 import admin_pb2, admin_pb2_grpc

    stub = admin_pb2_grpc.AdminStub(channel)
    while True:
        reply = await stub.ListWorkers(admin_pb2.ListWorkersRequest(), timeout=10)
        for w in reply.workers:
            into[w.address] = into.get(w.address, 0.0) + w.in_flight
        await asyncio.sleep(0.1)


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
        "| policy | engine-reported hit rate | cached / prompt tokens | TTFT p50 ms | "
        "TTFT p99 ms | output tok/s | completed |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.policy} | {r.engine_hit_rate:.1%} | {r.cached_prompt_tokens:,} / "
            f"{r.prompt_tokens:,} | {r.ttft_p50_ms:,.0f} | {r.ttft_p99_ms:,.0f} | "
            f"{r.output_tok_s:,.1f} | {r.completed}/{r.requests} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser("python -m bench.kv_routing", description=__doc__)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--requests", type=int, default=SPEC.requests)
    ap.add_argument("--rate", type=float, default=SPEC.rate, help="arrivals per second")
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    ap.add_argument("--seed", type=int, default=0)
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
    args = ap.parse_args(argv)
    configure_logging()
    spec = TenantSpec(
        **{**asdict(SPEC), "requests": args.requests, "rate": args.rate, "seed": args.seed}
    )
    workload = make_workload(spec, VOCAB)
    model = ensure_tiny_model()
    engine = {**systems.ENGINE_SETTINGS, "num_gpu_blocks_override": args.cache_blocks}
    results: list[RealResult] = []
    with tempfile.TemporaryDirectory(prefix="kv-routing-") as tmp, contextlib.ExitStack() as stack:
        logs = Path(tmp)
        addresses = []
        for i in range(args.workers):
            log.info("starting vLLM worker", worker=i + 1, of=args.workers)
            running = stack.enter_context(systems.pyworker(model, logs, engine))
            addresses.append(running.address)
        for i, policy in enumerate(args.policies):
            prompts = permuted(workload, args.seed * 1000 + i + 1)
            asyncio.run(fill_caches(addresses, args.cache_blocks, args.seed * 1000 + i))
            yaml = model_yaml(model, addresses, policy, args.kv_aware)
            with systems.control_plane(yaml, logs, name=f"control-{policy}") as (address, _):
                log.info("running", policy=policy, requests=workload.requests)
                r = asyncio.run(run_policy(address, workload, prompts, policy))
            results.append(r)
            shares = " ".join(f"{s:.2f}" for s in r.in_flight_share.values())
            print(
                f"{policy:16s} hit {r.engine_hit_rate:6.1%}  TTFT p50 {r.ttft_p50_ms:7.0f} ms  "
                f"p99 {r.ttft_p99_ms:7.0f} ms  {r.output_tok_s:6.1f} tok/s  "
                f"{r.completed}/{r.requests}  in flight by worker {shares}",
                flush=True,
            )
    print(markdown(results))
    if args.json:
        data: dict[str, Any] = {
            "command": " ".join(["python", "-m", "bench.kv_routing", *(argv or sys.argv[1:])]),
            "workload": describe(spec),
            "workers": args.workers,
            "engine_args": engine,
            "results": [asdict(r) for r in results],
        }
        args.json.write_text(json.dumps(data, indent=2) + "\n")
    return 0 if all(r.completed == r.requests for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
