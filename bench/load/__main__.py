"""Streaming load against one system, closed loop or Poisson arrivals; one line a run.

    python -m bench.load --target switchyard --address 127.0.0.1:50051 --model tiny \\
        --concurrency 1,4,16 [--rate 5,10] [--json out.json]

With `--processes N` (0: enough for `--expect-tokens-per-s`) a closed loop runs from
several client processes (bench.load.procload).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

from bench.load.loadgen import (
    TARGETS,
    Summary,
    Workload,
    closed_loop,
    make_target,
    open_loop,
    summarize,
)
from bench.load.procload import processes_for, spread_load


def _range(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    return int(low), int(high or low)


async def _main(args: Any) -> list[Summary]:
    target = make_target(args.target, args.address, args.model, args.connections)
    workload = Workload(
        requests=args.requests,
        prompt_len=_range(args.prompt_len),
        output_len=_range(args.output_len),
        seed=args.seed,
    )
    out = []
    try:
        if args.rate:
            for rate in args.rate:
                records = await open_loop(target, workload, rate)
                out.append(summarize(args.target, "open", rate, records))
        for c in args.concurrency or ([] if args.rate else [1]):
            records = await closed_loop(target, workload, c)
            out.append(summarize(args.target, "closed", c, records))
    finally:
        await target.close()
    return out


def main(argv: Sequence[str] | None = None) -> None:
    """python -m bench.load --target switchyard --address 127.0.0.1:50051 --model tiny
    --concurrency 1,4,16 [--rate 5,10] [--json out.json]"""
    import argparse

    p = argparse.ArgumentParser(
        "python -m bench.load", description="Streaming load against one system; one line a run"
    )
    p.add_argument("--target", choices=TARGETS, required=True)
    p.add_argument("--address", required=True, help="host:port (gRPC) or http://host:port")
    p.add_argument("--model", default="tiny")
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--rate", type=lambda s: [float(x) for x in s.split(",")], help="req/s")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--prompt-len", default="128", help="N or LOW-HIGH")
    p.add_argument("--output-len", default="128", help="N or LOW-HIGH")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--connections", type=int, default=1)
    p.add_argument(
        "--processes",
        type=int,
        default=1,
        help="client processes for a closed loop (0: enough for --expect-tokens-per-s)",
    )
    p.add_argument("--expect-tokens-per-s", type=float, default=0.0)
    p.add_argument("--json", help="write the summaries here")
    args = p.parse_args(argv)
    if args.processes != 1 and args.concurrency and not args.rate:
        _spread(args)
        return
    summaries = asyncio.run(_main(args))
    for s in summaries:
        print(
            f"{s.mode} {s.load:g}: {s.output_tokens_per_s:,.0f} tok/s, "
            f"{s.requests_per_s:.1f} req/s, TTFT p50/p90/p99 "
            f"{s.ttft_ms['p50']:.1f}/{s.ttft_ms['p90']:.1f}/{s.ttft_ms['p99']:.1f} ms, "
            f"ITL p50/p99 {s.itl_ms['p50']:.1f}/{s.itl_ms['p99']:.1f} ms, "
            f"E2E p50 {s.e2e_ms['p50']:.0f} ms, errors {s.errors}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump([s.to_json() for s in summaries], f, indent=1)


def _spread(args: Any) -> None:
    """A closed loop from several processes (bench.load.procload): one Python client tops out
    at some thousands of streamed tokens per second."""
    results = []
    for c in args.concurrency:
        procs = args.processes or processes_for(args.expect_tokens_per_s, c)
        work = Workload(
            requests=args.requests,
            prompt_len=_range(args.prompt_len),
            output_len=_range(args.output_len),
            seed=args.seed,
        )
        r = spread_load(
            args.target, args.address, args.model, work, c,
            processes=procs, connections=args.connections,
        )  # fmt: skip
        busiest = max(r["client_busy"])
        print(
            f"closed {c}: {r['tokens_per_s']:,.0f} tok/s, TTFT p50/p99 "
            f"{r['ttft_ms'].get('p50', 0):.1f}/{r['ttft_ms'].get('p99', 0):.1f} ms, "
            f"errors {r['errors']}; {r['client_processes']} client processes, the busiest "
            f"at {busiest:.2f} cores" + (" (the client was the limit: add processes)"
            if busiest > 0.9 else "")
        )  # fmt: skip
        results.append(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
