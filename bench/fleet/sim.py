"""Fleet simulation: the control plane's routing policies on many simulated workers.

No processes and no gRPC. Each worker is a virtual-clock `switchyard_runtime.SimExecutor`
(the C++ simulator: a latency model, not an inference engine) and every request is routed
by the real policy classes from `control.routing`. A discrete-event loop keeps one clock
per worker: the next event is either the next (seeded Poisson) arrival or one iteration of
the busy worker whose clock is furthest behind, whichever comes first.

    python -m bench.fleet.sim --workers 64 --requests 20000 --rate 1000 --seed 0 \\
        --markdown docs/results/fleet-simulation.md
"""

from __future__ import annotations

import argparse
import heapq
import inspect
import os
import platform
import random
import shlex
import statistics
import sys
import textwrap
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta
from math import nan
from pathlib import Path
from typing import Any

import switchyard_runtime as rt

from bench.fleet.workload import (
    TenantSpec,
    Workload,
    WorkloadSpec,
    describe,
    make_workload,
    reuse_ceiling,
)
from bench.results import write_json
from control.routing import POLICIES, IndexedPolicy, Policy, RouteRequest, make_policy
from control.routing.kv_index import KvIndex

_NOW = timedelta(0)

__all__ = ["Result", "SimParams", "TenantSpec", "WorkloadSpec", "make_workload", "simulate"]


@dataclass(frozen=True, slots=True)
class SimParams:
    """One worker's simulator configuration (all workers are alike)."""

    tokens_per_block: int = 16
    kv_blocks: int = 2048  # about 43 requests of 600 prompt + 160 output tokens
    max_batch: int = 64
    prefill_us_per_token: float = 50.0
    decode_step_us: float = 8000.0
    decode_us_per_request: float = 40.0
    prefix_cache_blocks: int = 512  # 16 prefixes of 512 tokens, less suffix churn
    vocab_size: int = 32000
    max_context: int = 4096

    def sim_config(self) -> Any:
        cfg = rt.SimConfig()
        cfg.virtual_clock = True
        for name, value in asdict(self).items():
            setattr(cfg, name, value)
        return cfg


# The tenants' traffic has prompts of up to 3,500 tokens, so its workers get four times the
# memory (131k tokens, about 64 requests of 2,000) and a prefix cache of 65k tokens: the
# cache holds a share of the conversations, not all of them.
TENANT_SIM = SimParams(kv_blocks=8192, prefix_cache_blocks=4096)


class SimWorker:
    """A simulated worker as a routing policy sees it (the `Candidate` protocol)."""

    def __init__(self, index: int, params: SimParams) -> None:
        self.index = index
        self.address = f"sim-{index:03d}:50051"
        self.running = 0  # from the worker's latest iteration stats
        self.waiting = 0
        self.in_flight = 0  # the simulation's own count, exact
        self.in_flight_tokens = 0  # prompt plus remaining output tokens of those
        self.in_flight_at_report = 0  # in_flight when running and waiting were read
        self.prefill_tokens = 0  # prompt tokens of in-flight requests with no token yet
        self.sim: Any = rt.SimExecutor(params.sim_config())
        self.t = 0.0  # this worker's clock, µs
        self.live: dict[int, int] = {}  # simulator request id -> request index


@dataclass(frozen=True, slots=True)
class Result:
    policy: str
    workers: int
    requests: int
    completed: int
    output_tokens: int
    makespan_s: float
    output_tok_s: float
    req_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    prompt_tokens: int
    cached_prompt_tokens: int
    prefix_hit_rate: float
    max_worker_requests: int
    min_worker_requests: int
    wall_s: float
    routers: int = 1


def build_policy(name: str, seed: int) -> Policy:
    """The named policy; a policy that takes a `seed` gets one, so runs repeat exactly."""
    if name not in POLICIES:
        return make_policy(name)  # raises with the list of known names
    cls = POLICIES[name]
    kwargs: dict[str, Any] = {}
    if "seed" in inspect.signature(cls).parameters:
        kwargs["seed"] = seed
    return cls(**kwargs)


def simulate(
    policy_name: str,
    workload: Workload,
    n_workers: int,
    params: SimParams | None = None,
    seed: int = 0,
    policy: Policy | None = None,
    cached_out: list[int] | None = None,
    ttft_out: list[float] | None = None,
    routers: int = 1,
) -> Result:
    """Route `workload` over `n_workers` simulated workers with the named policy (or the
    given one). `cached_out` and `ttft_out`, if given, get each request's cached prompt
    tokens and TTFT in ms, by request index.

    With `routers` > 1 there are that many router processes (`serve --routers N`), each
    with its own instance of the policy, and each request reaches one drawn at random, as
    the kernel spreads callers' connections: a policy's own memory (a learned tree, its
    eviction pressure) holds only what its router routed, while the engines' events reach
    every router. A simplification: every router sees the whole fleet's in-flight
    requests and queued prefill, where a real router counts only its own."""
    params = params or SimParams()
    if routers < 1:
        raise ValueError("routers must be at least 1")
    if policy is not None and routers > 1:
        raise ValueError("a given policy is one router's; pass routers=1")
    policies = (
        [policy]
        if policy is not None
        else [build_policy(policy_name, seed + r) for r in range(routers)]
    )
    draw = random.Random(seed)
    # A policy that follows KV-cache events gets every simulator's, as the control plane
    # feeds it (every router) the workers' SubscribeKvEvents streams.
    indexes = [p.index for p in policies if isinstance(p, IndexedPolicy) and p.follows_events]
    started = time.perf_counter()
    workers = [SimWorker(i, params) for i in range(n_workers)]
    n = workload.requests
    arrival, max_tokens = workload.arrival_us, workload.max_tokens
    prompt_len = [0] * n
    remaining = [0] * n
    first_us = [-1.0] * n
    per_worker = [0] * n_workers
    done = output_tokens = prompt_tokens = cached_tokens = 0
    end_us = 0.0
    busy: list[tuple[float, int]] = []  # (clock, worker index) of workers with work
    next_arrival = 0
    while next_arrival < n or busy:
        if next_arrival < n and (not busy or arrival[next_arrival] <= busy[0][0]):
            k = next_arrival
            next_arrival += 1
            prompt = workload.prompt(k)
            router = policies[draw.randrange(routers)] if routers > 1 else policies[0]
            chosen = router.choose(
                workers, RouteRequest(prompt, max_tokens[k], params.tokens_per_block)
            )
            assert isinstance(chosen, SimWorker)
            rid = chosen.sim.enqueue(rt.GenRequest(prompt, max_tokens[k], seed=k))
            chosen.live[rid] = k
            prompt_len[k] = len(prompt)
            remaining[k] = max_tokens[k]
            chosen.in_flight += 1
            chosen.in_flight_tokens += len(prompt) + max_tokens[k]
            chosen.prefill_tokens += len(prompt)
            per_worker[chosen.index] += 1
            if chosen.in_flight == 1:  # it was idle: its clock jumps to now
                chosen.t = max(chosen.t, arrival[k])
                heapq.heappush(busy, (chosen.t, chosen.index))
            continue
        _, i = heapq.heappop(busy)
        w = workers[i]
        cost = w.sim.step()
        if cost <= 0:
            raise RuntimeError(f"worker {w.address} made no progress with work queued")
        w.t += cost
        for r in w.sim.await_responses(_NOW):
            k = w.live[r.id]
            got = len(r.tokens)
            if first_us[k] < 0 and (got or r.is_final):
                w.prefill_tokens -= prompt_len[k]
            if first_us[k] < 0 and got:
                first_us[k] = w.t
            output_tokens += got
            remaining[k] -= got
            w.in_flight_tokens -= got
            if r.is_final:
                del w.live[r.id]
                w.in_flight -= 1
                w.in_flight_tokens -= prompt_len[k] + remaining[k]
                prompt_tokens += r.prompt_tokens
                cached_tokens += r.cached_prompt_tokens
                if cached_out is not None:
                    cached_out[k] = r.cached_prompt_tokens
                done += 1
                end_us = max(end_us, w.t)
        if indexes:
            feed_events(indexes, w)
        stats = w.sim.latest_stats()
        w.running, w.waiting = stats.active_requests, stats.queued_requests
        w.in_flight_at_report = w.in_flight
        if w.in_flight:
            heapq.heappush(busy, (w.t, i))
    wall_s = time.perf_counter() - started
    ttft = [(first_us[k] - arrival[k]) / 1000.0 for k in range(n) if first_us[k] >= 0]
    if ttft_out is not None:
        ttft_out[:] = [(first_us[k] - arrival[k]) / 1000.0 if first_us[k] >= 0 else nan
                       for k in range(n)]  # fmt: skip
    pct = statistics.quantiles(ttft, n=100, method="inclusive") if len(ttft) > 1 else [nan] * 99
    makespan_s = end_us / 1e6
    return Result(
        policy=policy_name,
        workers=n_workers,
        requests=n,
        completed=done,
        output_tokens=output_tokens,
        makespan_s=makespan_s,
        output_tok_s=output_tokens / makespan_s if makespan_s else 0.0,
        req_s=done / makespan_s if makespan_s else 0.0,
        ttft_p50_ms=pct[49],
        ttft_p99_ms=pct[98],
        prompt_tokens=prompt_tokens,
        cached_prompt_tokens=cached_tokens,
        prefix_hit_rate=cached_tokens / prompt_tokens if prompt_tokens else 0.0,
        max_worker_requests=max(per_worker),
        min_worker_requests=min(per_worker),
        wall_s=wall_s,
        routers=routers,
    )


def feed_events(indexes: Sequence[KvIndex], w: SimWorker) -> None:
    """The simulator's KV-cache events since the last call, into every index."""
    got = w.sim.take_kv_events(_NOW)
    for index in indexes:
        if got.lost:
            index.cleared(w.address)
        for e in got.events:
            if e.kind == "stored":
                index.stored(w.address, e.block_hashes, e.parent_hash, e.tokens, e.block_size)
            elif e.kind == "removed":
                index.removed(w.address, e.block_hashes)
            else:
                index.cleared(w.address)


COLUMNS = "policy|output tok/s|req/s|TTFT p50 ms|TTFT p99 ms|prefix-cache hit rate|sim wall s"


def row(r: Result) -> list[str]:
    numbers = (
        f"{r.output_tok_s:,.0f}|{r.req_s:,.1f}|{r.ttft_p50_ms:,.1f}|{r.ttft_p99_ms:,.1f}|"
        f"{r.prefix_hit_rate:.1%}|{r.wall_s:.1f}"
    )
    return [r.policy, *numbers.split("|")]


def markdown_table(results: Sequence[Result]) -> str:
    lines = ["| " + COLUMNS.replace("|", " | ") + " |", "|" + "---|" * len(row(results[0]))]
    lines += ["| " + " | ".join(row(r)) + " |" for r in results]
    return "\n".join(lines)


def interpret(results: Sequence[Result], offered_rate: float) -> list[str]:
    """Statements read off the measured numbers, nothing more."""
    by = {r.policy: r for r in results}
    base = by.get("round_robin")
    tp = max(results, key=lambda r: r.output_tok_s)
    hit = max(results, key=lambda r: r.prefix_hit_rate)
    low_hit = min(results, key=lambda r: r.prefix_hit_rate)
    p50 = min(results, key=lambda r: r.ttft_p50_ms)
    p99 = min(results, key=lambda r: r.ttft_p99_ms)
    out = []
    s = f"`{tp.policy}` had the highest output rate ({tp.output_tok_s:,.0f} tok/s"
    if base is not None and base is not tp:
        s += f", {tp.output_tok_s / base.output_tok_s:.2f}x `round_robin`"
    out.append(s + ").")
    out.append(
        f"`{hit.policy}` had the highest prefix-cache hit rate "
        f"({hit.prefix_hit_rate:.1%}); the lowest was `{low_hit.policy}` "
        f"({low_hit.prefix_hit_rate:.1%})."
    )
    worst = max(results, key=lambda r: r.ttft_p99_ms)
    out.append(
        f"The lowest TTFT p50 was `{p50.policy}`'s ({p50.ttft_p50_ms:,.1f} ms) and the lowest "
        f"p99 `{p99.policy}`'s ({p99.ttft_p99_ms:,.1f} ms; the highest p99 was "
        f"`{worst.policy}`'s, {worst.ttft_p99_ms:,.1f} ms)."
    )
    if hit is tp:
        out.append(
            "The policy with the most cache hits also had the highest throughput: in "
            "this model a hit skips `prefill_us_per_token` for every cached prompt "
            "token, leaving more of each iteration to decoding."
        )
    lo, hi = min(r.req_s for r in results), max(r.req_s for r in results)
    out.append(
        f"Offered load was {offered_rate:g} requests/s; completed requests/s over the makespan "
        f"ranged {lo:,.1f}-{hi:,.1f}."
    )
    if hi < 1.05 * lo and worst.ttft_p99_ms > 1.05 * p99.ttft_p99_ms * hi / lo:
        out.append("At this load the policies differ more in TTFT than in throughput.")
    spread = ", ".join(
        f"`{r.policy}` {r.min_worker_requests}-{r.max_worker_requests}" for r in results
    )
    out.append(f"Requests per worker (min-max): {spread}.")
    return out


def machine() -> dict[str, str]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    nproc = str(len(os.sched_getaffinity(0)))
    return {"nproc": nproc, "cpu": cpu, "python": platform.python_version()}


def report(
    command: str,
    spec: WorkloadSpec | TenantSpec,
    p: SimParams,
    results: Sequence[Result],
    ceiling: tuple[int, int],
) -> str:
    """The markdown report of one run; `ceiling` is the traffic's reuse ceiling (cached,
    prompt tokens; `fleet_workload.reuse_ceiling`)."""
    m = machine()
    n_workers = results[0].workers
    return reflow(f"""# Fleet simulation: routing policies on {n_workers} simulated workers

`bench/fleet/sim.py` compares the control plane's routing policies without processes or
gRPC. Every request is routed by the real policy classes from `control/routing/`; every
worker is a `switchyard_runtime.SimExecutor` on a virtual clock. **The SimExecutor is the
C++ simulator, not an inference engine**: it generates no real text and its timings come
from the latency model below, so the numbers compare policies under that model; they are
not measurements of any GPU or engine.

## What is simulated

- Workers: {n_workers}, all alike. Per iteration a worker costs
  `prefill_us_per_token` ({p.prefill_us_per_token:g} µs) for each uncached prompt token it
  admits, plus `decode_step_us` ({p.decode_step_us:g} µs) + `decode_us_per_request`
  ({p.decode_us_per_request:g} µs) per running request; every running request gains one
  token per iteration.
- Memory: {p.kv_blocks} KV blocks of {p.tokens_per_block} tokens per worker; a request
  reserves prompt plus `max_tokens` when admitted (at most {p.max_batch} running), the rest
  wait in FIFO order.
- Prefix cache: an LRU of {p.prefix_cache_blocks} full prompt blocks per worker; a prompt
  whose leading blocks are cached skips their prefill. A prompt's blocks are evicted from
  its end (its first block counts as the most recently used), as vLLM frees a request's
  blocks.
- Routers: {routers_line(results[0].routers)}
- Workload: {describe(spec)} Every policy gets the same arrivals.
- Event loop: each worker has its own clock; the next event is the next arrival or an
  iteration of the busy worker whose clock is furthest behind. A request is routed with
  each worker's running/waiting counts from its latest iteration and the simulation's
  in-flight requests and tokens per worker (an iteration is one event, so these may
  describe the end of an iteration that is still running at the arrival time); it joins
  the worker's next iteration. TTFT is the end of the iteration that emits a request's
  first token minus its arrival; throughput is over the makespan (time 0 to the last
  completion, so it includes the drain). Not modeled: network, tokenization, worker
  failures, reporting lag.

## Run

```
{command}
```

Machine: nproc {m["nproc"]}, {m["cpu"]}, Python {m["python"]}.

## Results

{markdown_table(results)}

The traffic's reuse ceiling, the hit rate of one cache that never evicts (what no
routing can beat), is {ceiling[0] / ceiling[1]:.1%}.
{" ".join(interpret(results, spec.rate))}
""")


def routers_line(routers: int) -> str:
    if routers == 1:
        return "one; the policy sees every request."
    return (
        f"{routers} (`serve --routers {routers}`), each with its own instance of the policy; "
        "each request reaches one drawn at random, so a policy's own memory holds what its "
        "router routed, while the engines' events reach every router. Every router sees "
        "the whole fleet's in-flight requests and queued prefill (a real one counts its "
        "own)."
    )


def reflow(md: str, width: int = 90) -> str:
    """Rewraps markdown prose (paragraphs, "- " items); headings, tables and code stay."""
    out: list[str] = []
    para: list[str] = []
    fenced = False

    def flush() -> None:
        if para:
            text = " ".join(x.strip() for x in para)
            indent = "  " if text.startswith("- ") else ""
            out.append(
                textwrap.fill(
                    text,
                    width,
                    subsequent_indent=indent,
                    break_long_words=False,
                    break_on_hyphens=False,
                )
            )
            para.clear()

    for line in md.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        prose = not fenced and line.strip() and not line.startswith(("```", "#", "|"))
        if not prose or line.startswith("- "):
            flush()
        (para if prose else out).append(line)
    flush()
    return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    fmt = argparse.RawDescriptionHelpFormatter
    ap = argparse.ArgumentParser("python -m bench.fleet.sim", None, __doc__, formatter_class=fmt)
    d, t = WorkloadSpec(), TenantSpec()
    ap.add_argument(
        "--workload",
        choices=("tenants", "groups"),
        default="tenants",
        help="tenants: system prompts, multi-turn conversations and one-off prompts "
        "(default); groups: shared prefixes plus unique suffixes",
    )
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--requests", type=int, help=f"default {t.requests} (groups: {d.requests})")
    ap.add_argument("--rate", type=float, help=f"arrivals/s; default {t.rate:g} ({d.rate:g})")
    ap.add_argument("--groups", type=int, default=d.groups, help="groups: prefix groups")
    ap.add_argument("--zipf", type=float, default=d.zipf, help="groups: popularity; 0 uniform")
    ap.add_argument("--tenants", type=int, default=t.tenants, help="tenants: how many")
    ap.add_argument(
        "--unique-share", type=float, default=t.unique_share, help="tenants: one-off prompts"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--routers", type=int, default=1, help="router processes, each with its own policy"
    )
    ap.add_argument(
        "--policies",
        nargs="+",
        default=list(POLICIES),
        choices=list(POLICIES),
        metavar="NAME",
        help=f"of {', '.join(POLICIES)}; default all",
    )
    ap.add_argument("--markdown", type=Path, help="write the report here")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)
    spec: WorkloadSpec | TenantSpec
    if args.workload == "groups":
        spec = WorkloadSpec(
            requests=args.requests or d.requests,
            rate=args.rate or d.rate,
            groups=args.groups,
            zipf=args.zipf,
            seed=args.seed,
        )
    else:
        spec = TenantSpec(
            requests=args.requests or t.requests,
            rate=args.rate or t.rate,
            tenants=args.tenants,
            unique_share=args.unique_share,
            seed=args.seed,
        )
    params = SimParams() if args.workload == "groups" else TENANT_SIM
    workload = make_workload(spec, params.vocab_size)
    widths = [max(len(c), 12) for c in COLUMNS.split("|")]
    widths[0] = max(map(len, args.policies))
    print("  ".join(c.rjust(w) for c, w in zip(COLUMNS.split("|"), widths, strict=True)))
    results = []
    for name in args.policies:
        r = simulate(name, workload, args.workers, params, seed=args.seed, routers=args.routers)
        results.append(r)
        print("  ".join(c.rjust(w) for c, w in zip(row(r), widths, strict=True)), flush=True)
        if r.completed != r.requests:
            print(f"{name}: only {r.completed} of {r.requests} completed", file=sys.stderr)
            return 1
    ceiling = reuse_ceiling(workload, params.tokens_per_block)
    print(f"reuse ceiling (one cache that never evicts): {ceiling[0] / ceiling[1]:.1%}")
    given = sys.argv[1:] if argv is None else list(argv)
    command = shlex.join(["python", "-m", "bench.fleet.sim", *given])
    if args.markdown:
        args.markdown.write_text(report(command, spec, params, results, ceiling))
    if args.json:
        data: dict[str, Any] = {"command": command, "workload": asdict(spec)}
        data["reuse_ceiling"] = {"cached_prompt_tokens": ceiling[0], "prompt_tokens": ceiling[1]}
        data |= {"sim": asdict(params), "machine": machine()}
        data["results"] = [asdict(r) for r in results]
        write_json(args.json, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
