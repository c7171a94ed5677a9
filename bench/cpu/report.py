"""docs/results/cpu.md (and its PNG plots) from one run's results (bench.cpu.compare): the
whole page, generated; the raw figures are in results/cpu/benchmarks.json.xz."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from bench.results import PAGES

PAGE = "cpu.md"
THROUGHPUT_PNG, TTFT_PNG = "cpu-throughput.png", "cpu-ttft.png"
RAW_NAME = "results/cpu/benchmarks.json.xz"
PER_CALL = "switchyard (a worker call per request)"
SYSTEMS = ("worker", "switchyard", PER_CALL, "vllm-grpc", "smg", "vllm-openai")
LABELS = {
    "worker": "Switchyard vLLM worker, direct",
    "switchyard": "Switchyard control plane → worker",
    PER_CALL: "control plane, a worker call per request",
    "vllm-grpc": "vLLM gRPC server",
    "smg": "SMG gateway → vLLM gRPC server",
    "vllm-openai": "vLLM OpenAI HTTP server",
}


def _by(results: list[dict[str, Any]]) -> dict[str, dict[int, list[dict[str, Any]]]]:
    out: dict[str, dict[int, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for r in results:
        out[r["system"]][int(r["load"])].append(r)
    return out


def _median(values: list[float]) -> float:
    s = sorted(values)
    if not s:
        return float("nan")
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def _spread(values: list[float]) -> str:
    return "" if len(values) < 2 else f" ({min(values):,.0f}-{max(values):,.0f})"


def write(data: dict[str, Any], out_dir: Path = PAGES, raw: str = RAW_NAME) -> None:
    """The page (OUT_DIR/cpu.md) and its plots from `data`, whose raw figures are at `raw`."""
    results: list[dict[str, Any]] = data["results"]
    by = _by(results)
    conc = sorted({int(r["load"]) for r in results})
    offline = float(data["offline"]["tokens_per_s"])
    tput = {
        s: {c: _median([r["output_tokens_per_s"] for r in by[s][c]]) for c in by[s]} for s in by
    }
    ttft50 = {s: {c: _median([r["ttft_ms"]["p50"] for r in by[s][c]]) for c in by[s]} for s in by}
    ttft99 = {s: {c: _median([r["ttft_ms"]["p99"] for r in by[s][c]]) for c in by[s]} for s in by}
    systems = [s for s in SYSTEMS if s in by]
    lines: list[str] = []
    add = lines.append
    m, v = data["machine"], data["versions"]
    add("# CPU benchmarks: Switchyard beside vLLM's own servers and the SMG gateway\n")
    add(
        f"Produced by `{data['command']}` at commit {data.get('commit', 'unknown')} in "
        f"{float(data['minutes']):.1f} minutes. "
        "Every system serves the same generated tiny Llama on vLLM for the CPU (float32, "
        "`max_num_batched_tokens` 16384), started by the benchmark on loopback, one engine "
        f"at a time. Closed loop, the same seeded workload with `ignore_eos`: "
        f"{data['workload']}. Systems "
        "that share an engine (the worker and the control plane in front of it; vLLM's gRPC "
        "server and SMG in front of it) are measured alternately at each level.\n"
    )
    add(
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gb']} GB, Python {m['python']}. "
        "The engine's busy loop takes most of one core, and the load generator and every "
        "serving front share the other, so these ratios describe this 2-core machine, not a "
        "GPU host. Runs of the same system vary by up to 2x here; treat single-run "
        "differences under ~20% as noise.\n"
    )
    add("Versions: " + ", ".join(f"{k} {val}" for k, val in v.items()) + ".\n")
    add(
        f"Offline ceiling (`vllm.LLM.generate`, {int(data['offline']['requests'])} requests "
        f"at once): **{offline:,.0f} output tokens/s**.\n"
    )

    add("## Throughput (output tokens/s; ratio to offline in brackets)\n")
    add("| concurrency | " + " | ".join(LABELS[s] for s in systems) + " |")
    add("|---|" + "---|" * len(systems))
    for c in conc:
        cells = []
        for s in systems:
            t = tput[s].get(c, float("nan"))
            spread = _spread([r["output_tokens_per_s"] for r in by[s].get(c, [])])
            cells.append(f"{t:,.0f}{spread} [{t / offline:.2f}]")
        add(f"| {c} | " + " | ".join(cells) + " |")
    add("")

    if "switchyard" in tput and "worker" in tput:
        add("## The control plane against the worker it fronts, and against the peers\n")
        peers = [s for s in ("vllm-grpc", "smg", "vllm-openai") if s in tput]
        add(
            "| concurrency | throughput vs direct worker | TTFT p50 overhead ms | "
            "TTFT p99 overhead ms | " + " | ".join(f"vs {p}" for p in peers) + " |"
        )
        add("|---|---|---|---|" + "---|" * len(peers))
        for c in conc:
            sw, w = tput["switchyard"].get(c), tput["worker"].get(c)
            if sw is None or w is None:
                continue
            d50 = ttft50["switchyard"][c] - ttft50["worker"][c]
            d99 = ttft99["switchyard"][c] - ttft99["worker"][c]
            vs = [f"{sw / tput[p][c]:.2f}" if c in tput[p] else "-" for p in peers]
            add(f"| {c} | {sw / w:.3f} | {d50:+.2f} | {d99:+.2f} | " + " | ".join(vs) + " |")
        add("")

    if "switchyard" in tput and "worker" in tput:
        _targets(add, data, by, tput, ttft50, ttft99, offline, conc)

    _cpu_table(add, by, systems, conc)

    add("## Time to first token (ms, p50 / p99)\n")
    add("| concurrency | " + " | ".join(LABELS[s] for s in systems) + " |")
    add("|---|" + "---|" * len(systems))
    for c in conc:
        cells = [
            f"{ttft50[s].get(c, float('nan')):.1f} / {ttft99[s].get(c, float('nan')):.1f}"
            for s in systems
        ]
        add(f"| {c} | " + " | ".join(cells) + " |")
    add("")

    opened = data.get("open_loop") or []
    if opened:
        _open_loop(add, opened)

    probe = data.get("ttft_probe") or {}
    if probe:
        add(
            "One request at a time, the direct worker and the control plane alternating "
            "request by request (2 output tokens, each with prompts of its own): TTFT "
            + "; ".join(
                f"{LABELS.get(k, k)} p50 {v['p50']:.2f} ms, p99 {v['p99']:.2f} ms "
                f"({int(v['samples'])} requests)"
                for k, v in probe.items()
            )
            + ".\n"
        )

    ceiling = data.get("control_plane_ceiling") or []
    if ceiling:
        _ceiling(add, data, ceiling)

    errors = [r for r in results if r["errors"]]
    if errors:
        add("## Errors\n")
        for r in errors:
            add(
                f"- {r['system']} at {int(r['load'])}: {r['errors']} failed "
                f"(first: {r['first_error']})"
            )
        add("")

    add(f"![throughput]({THROUGHPUT_PNG})\n")
    add(f"![ttft]({TTFT_PNG})\n")
    add(f"Raw numbers: `{raw}`.\n")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / PAGE).write_text("\n".join(lines))
    _plots(tput, ttft50, ttft99, offline, systems, conc, out_dir)


CPU_ROLES = ("control plane or gateway", "engine front", "engine", "load generator")


def _cpu_table(
    add: Any, by: dict[str, dict[int, list[dict[str, Any]]]], systems: list[str], conc: list[int]
) -> None:
    """Where the CPU goes, per output token: the cost this 2-core machine pays."""
    if not any(r.get("cpu_us_per_token") for s in systems for rs in by[s].values() for r in rs):
        return
    add("## CPU time per output token (µs; median of the runs)\n")
    add(
        "User plus system time of each process during the run, over the tokens it "
        "delivered. *Engine front* is the process that holds vLLM's `AsyncLLM` and its "
        "server (Switchyard's worker, vLLM's gRPC or OpenAI server); *engine* is vLLM's "
        "engine-core and model-runner processes. The engine's model runner is pinned to "
        "one core; everything else shares the other, so the CPU of the other columns "
        "decides the throughput here.\n"
    )
    for c in sorted({max(conc), 16} & set(conc)):
        add(f"At {c} concurrent requests:\n")
        add("| system | " + " | ".join(CPU_ROLES) + " | all but the load generator |")
        add("|---|" + "---|" * (len(CPU_ROLES) + 1))
        for s in systems:
            runs = [r.get("cpu_us_per_token") or {} for r in by[s].get(c, [])]
            if not any(runs):
                continue
            cells = []
            for role in CPU_ROLES:
                values = [r[role] for r in runs if role in r]
                cells.append(f"{_median(values):.0f}" if values else "-")
            served = [sum(v for k, v in r.items() if k != "load generator") for r in runs]
            add(f"| {LABELS[s]} | " + " | ".join(cells) + f" | {_median(served):.0f} |")
        add("")


def _open_loop(add: Any, opened: list[dict[str, Any]]) -> None:
    rate = opened[0]["load"]
    add(f"## Open loop: Poisson arrivals at {rate:g} requests/s (median of the runs)\n")
    add(
        "| system | output tokens/s | TTFT p50 / p99 ms | inter-token p50 / p99 ms | "
        "end-to-end p50 / p99 ms |"
    )
    add("|---|---|---|---|---|")
    by: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in opened:
        by[r["system"]].append(r)
    for system, runs in by.items():

        def med(key: str, q: str | None = None, runs: list[dict[str, Any]] = runs) -> float:
            return _median([r[key][q] if q else r[key] for r in runs])

        add(
            f"| {LABELS.get(system, system)} | {med('output_tokens_per_s'):,.0f} | "
            f"{med('ttft_ms', 'p50'):.1f} / {med('ttft_ms', 'p99'):.1f} | "
            f"{med('itl_ms', 'p50'):.1f} / {med('itl_ms', 'p99'):.1f} | "
            f"{med('e2e_ms', 'p50'):.0f} / {med('e2e_ms', 'p99'):.0f} |"
        )
    add("")


def _ceiling(add: Any, data: dict[str, Any], ceiling: list[dict[str, Any]]) -> None:
    add("## The control plane's own ceiling (C++ simulator workers, never the bottleneck)\n")
    add(
        "Two C++ workers on the simulator (200 µs a step, no prefill cost); 256 output "
        "tokens a request; the load generator spreads its streams over 8 connections. "
        "`x1` is one control-plane process; `x2` is `serve --routers 2`, two processes on "
        "one port (SO_REUSEPORT). On this 2-core machine the load generator, the "
        "routers and the workers share two cores, so a second process can add little.\n"
    )
    add(
        "| control plane | concurrent streams | output tokens/s | requests/s | TTFT p50 ms | "
        "TTFT p99 ms | tokens per message |"
    )
    add("|---|---|---|---|---|---|---|")
    for r in ceiling:
        add(
            f"| {r['system'].removeprefix('switchyard+sim ')} | {int(r['load'])} | "
            f"{r['output_tokens_per_s']:,.0f} | "
            f"{r['requests_per_s']:.1f} | {r['ttft_ms']['p50']:.1f} | "
            f"{r['ttft_ms']['p99']:.1f} | {r['tokens_per_message']:.1f} |"
        )
    add("")
    mem = data.get("memory", {})
    if mem:
        add(
            "Control-plane memory (RSS, one process): "
            + ", ".join(
                f"{k.replace('_mb', '').replace('_', ' ')} {val:.0f} MB" for k, val in mem.items()
            )
            + ".\n"
        )


def _targets(
    add: Any,
    data: dict[str, Any],
    by: dict[str, dict[int, list[dict[str, Any]]]],
    tput: dict[str, dict[int, float]],
    ttft50: dict[str, dict[int, float]],
    ttft99: dict[str, dict[int, float]],
    offline: float,
    conc: list[int],
) -> None:
    """The service's speed targets, each with its measured value from this run."""
    top, low = max(conc), min(conc)
    sw = tput["switchyard"]
    rows = [
        (
            "throughput through the control plane >= 0.97 of the direct worker (at "
            f"{top} concurrent)",
            sw[top] / tput["worker"][top],
            0.97,
        ),
        (
            f"throughput through the control plane >= 0.95 of offline (at {top}; a GPU target)",
            sw[top] / offline,
            0.95,
        ),
    ]
    for peer in ("vllm-grpc", "smg"):
        if peer in tput and top in tput[peer]:
            rows.append((f"at least as fast as {peer} (at {top})", sw[top] / tput[peer][top], 1.0))
    peers = [p for p in ("vllm-grpc", "smg", "vllm-openai") if p in tput]
    worst = [
        sw[c] / max(tput[p][c] for p in peers) for c in conc if all(c in tput[p] for p in peers)
    ]
    if peers and worst:
        rows.append(
            (
                "above every peer's ratio to offline at every concurrency (lowest "
                "control plane / best peer)",
                min(worst),
                1.0,
            )
        )
    add("## Targets in this run\n")
    add("| target | measured | met |")
    add("|---|---|---|")
    for name, value, goal in rows:
        add(f"| {name} | {value:.2f} | {'yes' if value >= goal else 'no'} |")
    probe = data.get("ttft_probe") or {}
    if "switchyard" in probe and "worker" in probe:
        d50 = probe["switchyard"]["p50"] - probe["worker"]["p50"]
        d99 = probe["switchyard"]["p99"] - probe["worker"]["p99"]
        where = f"{int(probe['worker']['samples'])} single requests each, alternating"
    else:
        d50 = ttft50["switchyard"][low] - ttft50["worker"][low]
        d99 = ttft99["switchyard"][low] - ttft99["worker"][low]
        where = f"at {low} concurrent"
    add(
        f"| control-plane TTFT overhead <= 1 ms p50 ({where}) | {d50:+.2f} ms | "
        f"{'yes' if d50 <= 1 else 'no'} |"
    )
    add(
        f"| control-plane TTFT overhead <= 3 ms p99 ({where}) | {d99:+.2f} ms | "
        f"{'yes' if d99 <= 3 else 'no'} |"
    )
    mem = data.get("memory", {})
    r1, r2 = mem.get("rss_after_round_1_mb"), mem.get("rss_after_round_2_mb")
    if r1 and r2:
        add(
            f"| memory flat over a long run (RSS after round 1 -> round 2) | "
            f"{r1:.0f} -> {r2:.0f} MB | {'yes' if r2 <= r1 * 1.05 else 'no'} |"
        )
    add("")

    def cpu(system: str, role: str) -> float:
        runs = [r.get("cpu_us_per_token") or {} for r in by.get(system, {}).get(top, [])]
        return _median([r[role] for r in runs if role in r])

    control = cpu("switchyard", "control plane or gateway")
    saved = cpu("worker", "engine front") - cpu("switchyard", "engine front")
    if control == control and saved == saved:  # both measured (not NaN)
        add(
            "Where a target is missed, the cause is CPU on this machine: vLLM pins its model "
            "runner to one core, and every serving process shares the other with the load "
            f"generator, so throughput follows the CPU each system spends per token. At {top} "
            f"concurrent requests the control plane spent {control:.0f} µs of CPU per token, "
            "most of it grpc.aio's own work for the one message per token that every client "
            f"stream needs; `GenerateStream` saved the worker {saved:.0f} µs per token "
            "against a call per request. On a GPU host the engine does not compete for "
            "these cores, and `serve --routers N` adds processes when one is not enough.\n"
        )


def _plots(
    tput: dict[str, dict[int, float]],
    ttft50: dict[str, dict[int, float]],
    ttft99: dict[str, dict[int, float]],
    offline: float,
    systems: list[str],
    conc: list[int],
    out_dir: Path,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for s in systems:
        cs = sorted(tput[s])
        ax.plot(cs, [tput[s][c] for c in cs], marker="o", label=LABELS[s])
    ax.axhline(offline, color="grey", linestyle="--", label="offline engine")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens/s")
    ax.set_title("Throughput against concurrency (tiny model, vLLM CPU)")
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_dir / THROUGHPUT_PNG, dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 5))
    width = 0.8 / max(len(systems), 1)
    for i, s in enumerate(systems):
        xs = [j + i * width for j in range(len(conc))]
        ax.bar(xs, [ttft50[s].get(c, 0) for c in conc], width, label=f"{LABELS[s]} p50")
        ax.scatter(xs, [ttft99[s].get(c, 0) for c in conc], marker="_", s=200, color="black")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(conc))], [str(c) for c in conc])
    ax.set_yscale("log")
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("time to first token, ms (bar p50, tick p99)")
    ax.set_title("TTFT distribution")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / TTFT_PNG, dpi=110)
    plt.close(fig)
