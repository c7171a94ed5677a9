"""docs/results/gpu.md, the 8B phases on the H200, from the result folders of `bench.gpu` runs.

    python -m bench.gpu --report RESULTS/fronts1 RESULTS/peers RESULTS/quant RESULTS/fronts2

Each folder holds one phase's JSON (and, for `fronts`, the GPU memory CSV). The raw
results go to results/gpu/8b.json.xz, the memory plot to docs/results/gpu-memory.png, and
the whole page is generated.

A run is a "first pass" when it is a system's first run at that load after its 32-request
warm-up, and "settled" when the same engine ran that load before: on vLLM 0.26 the first
pass at a new load is slower for every system (batch shapes still compiling and
capturing), so only like is compared with like.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from bench.results import PAGES, RAW, commit, relative, write_json

PAGE = "gpu.md"
MEMORY_PNG = "gpu-memory.png"
COMMAND = (
    "`scripts/gpu-bench.sh run fronts`, `... run peers`, `... run quant` and `... run fronts` "
    "again (device calls on the lent H200; `scripts/gpu-bench.sh` says how the vLLM bundle "
    "travels), then `python -m bench.gpu --report` on the four result folders"
)


LABELS = {
    "asyncllm": "vLLM AsyncLLM in-process (ceiling)",
    "worker": "Switchyard worker, direct",
    "control plane": "Switchyard control plane → worker",
    "openai": "vLLM OpenAI server",
    "vLLM gRPC server": "vLLM gRPC server",
}
# (what, (numerator, its pass), (denominator, its pass)), with the targets
RATIOS = (
    ("worker / AsyncLLM in-process, settled", ("worker", "settled"), ("asyncllm", "settled")),
    ("worker / AsyncLLM in-process, first pass", ("worker", "first"), ("asyncllm", "first")),
    ("control plane / worker, settled", ("control plane", "settled"), ("worker", "settled")),
    ("worker / vLLM OpenAI server, first pass", ("worker", "first"), ("openai", "first")),
    ("worker / vLLM gRPC server, first pass", ("worker", "first"), ("vLLM gRPC server", "first")),
)
RAW_NAME = "results/gpu/8b.json.xz"
TARGETS = ("≥ 0.97", "≥ 0.97", "≥ 0.97", "> 1", "≥ 1")


def lowest(p: dict[tuple[str, str, int], list[float]], name: str, load: int) -> float:
    runs = p.get((name, "first", load), []) + p.get((name, "settled", load), [])
    return min(runs) if runs else float("nan")


def _load(folders: list[Path]) -> list[dict[str, Any]]:
    phases = []
    for folder in folders:
        for path in sorted(folder.glob("*.json")):
            data = json.loads(path.read_text())
            data["folder"] = folder.name
            csv = folder / "gpu-memory-bf16.csv"
            if csv.exists():
                data["gpu_memory_csv"] = csv.read_text()
            phases.append(data)
    return phases


def _passes(phases: list[dict[str, Any]]) -> dict[tuple[str, str, int], list[float]]:
    """(system, pass, load) -> tokens/s, where pass is 'first' or 'settled'."""
    out: dict[tuple[str, str, int], list[float]] = {}
    for phase in phases:
        for system in phase["systems"]:
            label = system.get("label", "?")
            seen: set[int] = set()  # loads this engine already ran
            for run in system.get("runs", []):
                name = run["system"] if label in ("bf16", "asyncllm") else label
                name = {"switchyard": "control plane", "vllm-grpc": "vLLM gRPC server"}.get(
                    name, name
                )
                load = int(run["requests"])
                kind = "settled" if load in seen else "first"
                seen.add(load)
                out.setdefault((name, kind, load), []).append(float(run["tokens_per_s"]))
    return out


def _fmt(values: list[float] | None) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:,.0f}"
    return f"{statistics.fmean(values):,.0f} ({min(values):,.0f}-{max(values):,.0f})"


def _ratio(a: list[float] | None, b: list[float] | None) -> str:
    if not a or not b:
        return "-"
    return f"{statistics.fmean(a) / statistics.fmean(b):.2f}"


def _memory(phases: list[dict[str, Any]]) -> tuple[list[float], list[float], float]:
    """Seconds, MiB in use and the card's MiB, from the last nvidia-smi CSV."""
    for phase in reversed(phases):
        csv = phase.get("gpu_memory_csv")
        if csv:
            rows = [line.split(",") for line in csv.strip().splitlines() if line.strip()]
            used = [float(r[1]) for r in rows]
            return [0.5 * i for i in range(len(used))], used, float(rows[0][2])
    return [], [], 0.0


def _plot(t: list[float], used: list[float], total: float, share: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.plot(t, [u / 1024 for u in used], marker=".", label="memory.used (nvidia-smi)")
    ax.set_xlabel("seconds into the run (100 concurrent requests, 128 in / 256 out)")
    ax.set_ylabel("GiB")
    ax.set_ylim(0, 145)
    ax.axhline(total / 1024, color="grey", linestyle=":", label="the card's memory")
    ax.legend(loc="lower right")
    ax.set_title(f"GPU memory in use, 8B bf16, gpu_memory_utilization {share:g}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _workers(phases: list[dict[str, Any]], label: str, key: str) -> dict[str, Any]:
    for phase in phases:
        for system in phase["systems"]:
            if system.get("label") == label and system.get(key):
                return dict(system[key][0])
    return {}


def page(phases: list[dict[str, Any]], commit: str = "unknown", raw: str = RAW_NAME) -> str:
    """The whole page: the 8B phases' figures, the command and the commit."""
    env = phases[0]["environment"]
    p = _passes(phases)
    lines: list[str] = []
    add = lines.append
    settings = ", ".join(f"`{k}: {json.dumps(v)}`" for k, v in env["settings"].items())
    add("# GPU benchmarks: the vLLM path on an NVIDIA H200 against vLLM's own fronts\n")
    add(f"Made by {COMMAND}, at commit {commit}.\n")
    gpu = env["gpu"].splitlines()[-1] if env.get("gpu") else "?"
    add(
        f"Machine: {gpu}, {env['cpus']} CPU cores; vLLM {env['vllm']}, torch {env['torch']}, "
        f"Python {env['python']}. Model: a Llama-3.1-8B shape with random weights "
        "(`load_format: dummy`, config.json only) and a word-level tokenizer of its "
        "vocabulary. Workload (the guide's): every request at once, "
        f"{env['workload']['prompt']} prompt and {env['workload']['output']} output tokens, "
        f"`ignore_eos`, at 100 and at 1000 requests, sent by {env['client_processes']} client "
        "processes (so that no Python client is the limit), streamed.\n"
    )
    add(f"Every system got the same engine settings: {settings}.\n")
    add(
        "Systems: vLLM's `AsyncLLM` in the benchmark's own process with DELTA outputs (the "
        "ceiling for any front), Switchyard's vLLM worker called directly, the control plane "
        "in front of that same worker (`switchyard serve` started it with the settings "
        "above, one control-plane process), vLLM's OpenAI server (`/v1/completions`, "
        "streaming, token-id prompts) and vLLM's gRPC server "
        "(`vllm.entrypoints.grpc_server`). The worker and the control plane share one engine "
        "and were measured in the order worker, control plane, control plane, worker at "
        "each load.\n"
    )
    add(
        "**First pass and settled.** On vLLM 0.26 every system's first run at a load is "
        "slower than the next on the same engine (AsyncLLM itself: "
        f"{_fmt(p.get(('asyncllm', 'first', 100)))} then "
        f"{_fmt(p.get(('asyncllm', 'settled', 100)))} tokens/s at 100; "
        f"{_fmt(p.get(('asyncllm', 'first', 1000)))} then "
        f"{_fmt(p.get(('asyncllm', 'settled', 1000)))} at 1000), so runs are compared only "
        "with runs of the same kind. vLLM's servers were given one pass each (device time), "
        "so they are compared with first passes.\n"
    )
    add("### Throughput (output tokens/s; mean and range where there are several runs)\n")
    add("| system | 100, first pass | 100, settled | 1000, first pass | 1000, settled |")
    add("|---|---|---|---|---|")
    for name, label in LABELS.items():
        cells = [_fmt(p.get((name, k, n))) for n in (100, 1000) for k in ("first", "settled")]
        add(f"| {label} | " + " | ".join(cells) + " |")
    add("")
    add("Every run, in the order it ran (device call, engine, system, load: tokens/s):\n")
    for phase in phases:
        for system in phase["systems"]:
            if "error" in system:
                add(f"- {phase['folder']}, {system['label']}: failed: {system['error']}")
                continue
            order = ", ".join(
                f"{r['system']} {r['requests']}: {r['tokens_per_s']:,.0f}" for r in system["runs"]
            )
            add(f"- {phase['folder']}, engine {system['label']}: {order}")
    add("")
    add("### Ratios against the targets\n")
    add("| ratio | 100 | 1000 | target |")
    add("|---|---|---|---|")

    def row(text: str, a: str, b: str, kind_a: str, kind_b: str, target: str) -> None:
        cells = [_ratio(p.get((a, kind_a, n)), p.get((b, kind_b, n))) for n in (100, 1000)]
        add(f"| {text} | {cells[0]} | {cells[1]} | {target} |")

    for (text, (a, kind_a), (b, kind_b)), target in zip(RATIOS, TARGETS, strict=True):
        row(text, a, b, kind_a, kind_b, target)
    add("")
    add(
        "The control plane never had a first pass of its own (the worker ran first at each "
        "load), so its comparison with vLLM's servers goes through the worker it fronts "
        "(control plane / worker above). Its lowest run at each load was "
        f"{lowest(p, 'control plane', 100):,.0f} and {lowest(p, 'control plane', 1000):,.0f} "
        "tokens/s.\n"
    )
    pairs = [s["ttft_pairs"] for ph in phases for s in ph["systems"] if s.get("ttft_pairs")]
    if pairs:
        add("### Time to first token, one request at a time\n")
        if all(t.get("distinct_prompts") for t in pairs):
            add(
                "Single requests (2 output tokens), alternating request by request between the "
                "worker and the control plane in front of it, each with prompts of its own "
                "(bench.cpu.compare's probe):\n"
            )
        else:
            add(
                "Single requests (128 prompt tokens, 16 output), alternating between the "
                "worker and the control plane in front of it, after 5 pairs of warm-up:\n"
            )
        add(
            "| run | pairs | worker p50 / p99 ms | control plane p50 / p99 ms "
            "| overhead p50 / p99 ms |"
        )
        add("|---|---|---|---|---|")
        for i, t in enumerate(pairs, 1):
            w, s, o = t["worker_ms"], t["switchyard_ms"], t["overhead_ms"]
            add(
                f"| {i} | {t['pairs']} | {w['p50']:.2f} / {w['p99']:.2f} | "
                f"{s['p50']:.2f} / {s['p99']:.2f} | +{o['p50']:.2f} / +{o['p99']:.2f} |"
            )
        p50s = [t["overhead_ms"]["p50"] for t in pairs]
        met = all(x <= 1.0 for x in p50s)
        add(
            f"\nThe target is at most 1 ms p50: **{'met' if met else 'not met'}** "
            f"(+{min(p50s):.2f} to +{max(p50s):.2f} ms p50)."
        )
        if not all(t.get("distinct_prompts") for t in pairs):
            add(
                "These pairs sent the same prompt to the worker and then to the control "
                "plane, on one engine with prefix caching on: the control plane's request "
                "found the worker's KV blocks, so its overhead is understated, a lower bound. "
                "bench.gpu now gives each its own prompts."
            )
        add("")
    add("### Quantization and KV-cache dtype (through the control plane, first passes)\n")
    add(
        "| setting | KV blocks (16 tokens) | 100: tokens/s | 100: TTFT p50 ms | 1000: tokens/s "
        "| 1000: TTFT p50 ms | tokens/s vs bf16 (first pass, worker) |"
    )
    add("|---|---|---|---|---|---|---|")
    bf16 = _workers(phases, "bf16", "workers_at_start")
    quant_rows: list[tuple[str, dict[str, Any], list[dict[str, Any]]]] = []
    for phase in phases:
        for system in phase["systems"]:
            if system.get("label") in ("fp8", "kv-fp8"):
                quant_rows.append((system["label"], system["workers_at_start"][0], system["runs"]))
    first_bf16 = [
        r for ph in phases for s in ph["systems"] if s.get("label") == "bf16" for r in s["runs"]
    ]
    add(
        f"| bf16 (`dtype: bfloat16`) | {int(bf16.get('kv_blocks_total', 0)):,} | "
        f"{_fmt(p.get(('worker', 'first', 100)))} | "
        f"{_first_ttft(first_bf16, 'worker', 100)} | {_fmt(p.get(('worker', 'first', 1000)))} | "
        f"{_first_ttft(first_bf16, 'worker', 1000)} | 1.00 |"
    )
    for label, w, quant_runs in quant_rows:
        setting = "`quantization: fp8`" if label == "fp8" else "`kv_cache_dtype: fp8`"
        by = {int(r["requests"]): r for r in quant_runs}
        ratio = " / ".join(
            _ratio([by[n]["tokens_per_s"]], p.get(("worker", "first", n))) for n in (100, 1000)
        )
        add(
            f"| {setting} | {int(w['kv_blocks_total']):,} | {by[100]['tokens_per_s']:,.0f} | "
            f"{by[100]['ttft_ms']['p50']:.0f} | {by[1000]['tokens_per_s']:,.0f} | "
            f"{by[1000]['ttft_ms']['p50']:.0f} | {ratio} |"
        )
    add(
        "\nWhat ListWorkers reported for each engine (weight and KV dtypes, quantization, KV "
        f"blocks) is in `{raw}` (`workers_at_start`).\n"
    )
    t, used, total = _memory(phases)
    if used:
        under = _workers(phases, "bf16", "workers_under_load")
        share = env["settings"].get("gpu_memory_utilization", "vLLM's default")
        add("### GPU memory through the guide's workload\n")
        add(
            f"Sampled every 0.5 s by nvidia-smi through the 100-request run ({len(used)} "
            f"samples): min {min(used):,.0f} MiB, max {max(used):,.0f} MiB of {total:,.0f}. "
            "vLLM takes its whole `gpu_memory_utilization` share when it starts (weights, "
            "activations, CUDA graphs, and every KV block it can fit), so the memory in use "
            "does not move with load: what moves is the share of KV blocks in use, "
            f"{int(under.get('kv_blocks_used', 0)):,} of {int(under.get('kv_blocks_total', 0)):,} "
            "under 100 requests of 384 tokens (ListWorkers during the run). The guide saw "
            "35-45 GB for vLLM; how much vLLM holds is what `gpu_memory_utilization` says, "
            f"{share} of the card here, not what the load needs.\n"
        )
        add(f"![GPU memory]({MEMORY_PNG})\n")
    add(f"Raw results: `{raw}`.")
    return "\n".join(lines) + "\n"


def _first_ttft(runs: list[dict[str, Any]], system: str, load: int) -> str:
    for r in runs:
        if r["system"] == system and int(r["requests"]) == load:
            return f"{r['ttft_ms']['p50']:.0f}"
    return "-"


def write_report(
    folders: list[Path], pages: Path = PAGES, raw: Path = RAW / "gpu" / "8b.json.xz"
) -> None:
    """The raw results of `folders` to `raw`, the page and its memory plot to `pages`."""
    phases = _load(folders)
    if not phases:
        raise SystemExit("no results in " + ", ".join(map(str, folders)))
    write_json(raw, [{k: v for k, v in ph.items() if k != "gpu_memory_csv"} for ph in phases])
    pages.mkdir(parents=True, exist_ok=True)
    t, used, total = _memory(phases)
    if used:
        share = float(phases[0]["environment"]["settings"].get("gpu_memory_utilization", 0))
        _plot(t, used, total, share, pages / MEMORY_PNG)
    md = pages / PAGE
    ran_at = phases[0]["environment"].get("commit") or commit()
    md.write_text(page(phases, ran_at, relative(raw)))
    print(f"wrote {md}, {raw}")
