"""Closed-loop load from several client processes, for rates one Python process cannot drive.

One asyncio client tops out at some thousands of streamed tokens per second; past that
it, not the system under test, sets the figure. `spread_load` splits the concurrent
streams over enough processes for the expected token rate (`processes_for`), starts them
together, and merges their records. Every result says how many processes it used and
how busy each was (CPU seconds per wall second): a client near 1.0 was the limit.

    python -m bench.load.procload --target switchyard --address 127.0.0.1:50051 --model m \\
        --concurrency 1000 --requests 2000 --rate 30000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict
from typing import Any

from bench.load.loadgen import Workload, closed_loop, make_target

# Streamed tokens per second one client process drives comfortably (measured on the H200
# machine's cores at about 9k before it saturates; this leaves headroom).
CLIENT_TOKENS_PER_S = 6000
MAX_PROCESSES = 16


def processes_for(rate: float, concurrency: int, cpus: int | None = None) -> int:
    """Client processes for an expected `rate` of tokens/s: enough that none is the
    limit, at most one per spare core and one per stream."""
    cpus = cpus or os.cpu_count() or 1
    want = max(1, math.ceil(rate / CLIENT_TOKENS_PER_S))
    return max(1, min(want, max(1, cpus // 2), MAX_PROCESSES, concurrency))


def _client(args: argparse.Namespace) -> None:
    """One client process: its share of the run, raw figures as JSON on stdout."""
    w = args.work
    work = Workload(
        requests=int(w["requests"]),
        prompt_len=(int(w["prompt_len"][0]), int(w["prompt_len"][1])),
        output_len=(int(w["output_len"][0]), int(w["output_len"][1])),
        vocab=(int(w["vocab"][0]), int(w["vocab"][1])),
        seed=int(w["seed"]),
    )

    async def go() -> dict[str, Any]:
        target = make_target(args.target, args.address, args.model, args.connections)
        await asyncio.sleep(max(0.0, args.start_at - time.time()))  # all start together
        cpu0 = time.process_time()
        started = time.time()
        try:
            records = await closed_loop(target, work, args.concurrency)
        finally:
            await target.close()
        ok = [r for r in records if r.error is None]
        wall = max((r.end or r.start) for r in records) - min(r.start for r in records)
        return {
            "wall_start": started,
            "wall_end": started + wall,
            "busy": (time.process_time() - cpu0) / max(wall, 1e-9),
            "tokens": sum(r.tokens for r in ok),
            "messages": sum(r.messages for r in ok),
            "errors": [r.error for r in records if r.error is not None][:3],
            "error_count": len(records) - len(ok),
            "ttft_ms": [r.ttft * 1000 for r in ok if r.ttft is not None],
            "itl_ms": [
                (b - a) * 1000
                for r in ok
                for a, b in zip(r.token_times, r.token_times[1:], strict=False)
            ][::7],  # a sample keeps the output small
        }

    print(json.dumps(asyncio.run(go())), flush=True)


def start_delay_s(processes: int) -> float:
    """How long after `spread_load` is called its clients start sending: time for every
    client process to import (a profile or a probe of the load waits this long)."""
    return 3.0 + 0.2 * processes


def spread_load(
    target: str,
    address: str,
    model: str,
    work: Workload,
    concurrency: int,
    *,
    processes: int,
    connections: int = 1,
    timeout_s: float = 900.0,
) -> dict[str, Any]:
    """`work.requests` requests, `concurrency` at a time, from `processes` processes."""
    procs = max(1, min(processes, concurrency, work.requests))
    start_at = time.time() + start_delay_s(procs)

    def argv(i: int) -> list[str]:
        share = Workload(
            requests=work.requests // procs + (1 if i < work.requests % procs else 0),
            prompt_len=work.prompt_len,
            output_len=work.output_len,
            vocab=work.vocab,
            seed=work.seed * 100 + i,
        )
        return [
            sys.executable, "-m", "bench.load.procload", "--client", "--target", target,
            "--address", address, "--model", model, "--connections", str(connections),
            "--concurrency", str(concurrency // procs + (1 if i < concurrency % procs else 0)),
            "--work", json.dumps(asdict(share)), "--start-at", str(start_at),
        ]  # fmt: skip

    children = [subprocess.Popen(argv(i), stdout=subprocess.PIPE, text=True) for i in range(procs)]
    try:
        parts = []
        for c in children:
            out = c.communicate(timeout=timeout_s)[0].strip().splitlines()
            if c.returncode != 0 or not out:
                raise RuntimeError(f"load client exited with {c.returncode}")
            parts.append(json.loads(out[-1]))
    finally:
        for c in children:  # one that failed leaves none of the others behind
            if c.poll() is None:
                c.kill()
                c.wait()
    begin = min(p["wall_start"] for p in parts)
    end = max(p["wall_end"] for p in parts)
    tokens = sum(p["tokens"] for p in parts)
    return {
        "system": target,
        "requests": work.requests,
        "concurrency": concurrency,
        "tokens": tokens,
        "messages": sum(p["messages"] for p in parts),
        "seconds": end - begin,
        "tokens_per_s": tokens / (end - begin),
        "errors": sum(p["error_count"] for p in parts),
        "first_errors": [e for p in parts for e in p["errors"]][:3],
        "ttft_ms": percentiles([x for p in parts for x in p["ttft_ms"]]),
        "itl_ms": percentiles([x for p in parts for x in p["itl_ms"]]),
        "client_processes": procs,
        "client_busy": [round(p["busy"], 2) for p in parts],
    }


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    s = sorted(values)

    def q(p: float) -> float:
        return s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))]

    return {"p50": q(50), "p90": q(90), "p99": q(99)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True)
    p.add_argument("--address", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--concurrency", type=int, default=100)
    p.add_argument("--requests", type=int, default=0, help="default: twice the concurrency")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--output", type=int, default=256)
    p.add_argument("--vocab", default="4-500", help="prompt token ids from this range")
    p.add_argument("--rate", type=float, default=0.0, help="expected tokens/s (picks processes)")
    p.add_argument("--processes", type=int, default=0, help="default: from --rate")
    p.add_argument("--connections", type=int, default=1, help="channels per client process")
    p.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--work", type=json.loads, help=argparse.SUPPRESS)
    p.add_argument("--start-at", type=float, default=0.0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.client:
        _client(args)
        return
    lo, _, hi = args.vocab.partition("-")
    work = Workload(
        requests=args.requests or 2 * args.concurrency,
        prompt_len=(args.prompt, args.prompt),
        output_len=(args.output, args.output),
        vocab=(int(lo), int(hi or lo)),
    )
    procs = args.processes or processes_for(args.rate, args.concurrency)
    result = spread_load(
        args.target,
        args.address,
        args.model,
        work,
        args.concurrency,
        processes=procs,
        connections=args.connections,
    )
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
