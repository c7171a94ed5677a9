"""Plots of the routing comparison (docs/results/kv-routing.md) from the benchmarks' JSON:

    python -m bench.fleet.kv_plots --sim results/kv-routing/sim-seed*.json.xz \\
        --rates results/kv-routing/sim-rate*.json.xz results/kv-routing/sim-seed0.json.xz \\
        --real results/kv-routing/real.json.xz --restart results/kv-routing/real-restart.json.xz \\
        --seeds results/kv-routing/real-seeds-2-4.json.xz results/kv-routing/real-seeds.json.xz \\
        --out docs/results/kv-routing

`--sim` takes `bench.fleet.sim --json` files (one per seed: bars are the mean, whiskers
the range); `--rates` such files at several offered loads (TTFT p99 against the load);
`--real` and `--restart` `bench.fleet.kv_routing --json` files (bars per number of routers and
of restarts); `--seeds` such files, one router's runs seed by seed. Needs matplotlib (the
bench extra).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.fleet import kv_summary
from bench.results import read_json


def _by_policy(files: Sequence[Path], fields: Sequence[str]) -> dict[str, dict[str, list[float]]]:
    """policy -> field -> one value per file, in the order the first file lists them."""
    out: dict[str, dict[str, list[float]]] = {}
    for f in files:
        for r in read_json(f)["results"]:
            row = out.setdefault(r["policy"], {k: [] for k in fields})
            for k in fields:
                row[k].append(float(r[k]))
    return out


def _spread(groups: Sequence[Sequence[float]]) -> tuple[list[float], list[float], list[float]]:
    """Each group's mean, and how far below and above it its lowest and highest value lie
    (a bar and its whiskers); 0 for an empty group."""
    means = [statistics.mean(g) if g else 0.0 for g in groups]
    low = [m - min(g, default=m) for m, g in zip(means, groups, strict=True)]
    high = [max(g, default=m) - m for m, g in zip(means, groups, strict=True)]
    return means, low, high


def _bars(ax: Any, data: dict[str, dict[str, list[float]]], field: str, scale: float = 1.0) -> None:
    names = list(data)
    means, low, high = _spread([[v * scale for v in data[n][field]] for n in names])
    colors = ["tab:red" if n == "kv_aware" else "tab:grey" for n in names]
    ax.bar(names, means, color=colors, yerr=[low, high], capsize=3)
    ax.tick_params(axis="x", labelrotation=35, labelsize=8)
    ax.grid(True, axis="y", alpha=0.3)


def plot_sim(files: Sequence[Path], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = _by_policy(files, ("ttft_p50_ms", "ttft_p99_ms", "prefix_hit_rate", "output_tok_s"))
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2))
    _bars(axes[0], data, "ttft_p99_ms")
    axes[0].set_ylabel("TTFT p99, ms (lower is better)")
    _bars(axes[1], data, "prefix_hit_rate", 100)
    axes[1].set_ylabel("prefix-cache hit rate, % of prompt tokens")
    _bars(axes[2], data, "output_tok_s", 1 / 1000)
    axes[2].set_ylabel("output tokens/s, thousands")
    first = read_json(files[0])
    workers = first["results"][0]["workers"]
    title = (
        f"Fleet simulation, {workers} simulated workers, tenants' traffic "
        f"({len(files)} seeds: bar = mean, whiskers = range)"
    )
    return _save(fig, title, out / "sim.png")


def _save(fig: Any, title: str, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_rates(files: Sequence[Path], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = sorted((read_json(f) for f in files), key=lambda d: d["workload"]["rate"])
    rates = [d["workload"]["rate"] for d in runs]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name in [r["policy"] for r in runs[0]["results"]]:
        p99 = [next(r["ttft_p99_ms"] for r in d["results"] if r["policy"] == name) for d in runs]
        style = {"color": "black", "linewidth": 2.5} if name == "kv_aware" else {}
        ax.plot(rates, p99, marker="o", label=name, **style)
    ax.set_yscale("log")
    ax.set_xlabel("offered load, requests/s")
    ax.set_ylabel("TTFT p99, ms")
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
    workers = runs[0]["results"][0]["workers"]
    return _save(
        fig, f"Fleet simulation, {workers} workers: TTFT p99 against load", out / "rates.png"
    )


def plot_real(file: Path, out: Path, name: str = "real.png") -> Path:
    """One group of bars per policy, one bar per number of routers and of restarts (the
    mean over the seeds, whiskers the range); the reuse ceiling (mean) as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = read_json(file)
    results = run["results"]
    names = list(dict.fromkeys(r["policy"] for r in results))

    def setup(r: dict[str, Any]) -> tuple[int, int]:
        return r.get("routers", 1), r.get("restarts", 0)

    setups = sorted({setup(r) for r in results})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    width = 0.8 / len(setups)
    for j, (n, restarts) in enumerate(setups):
        xs = [i + (j - (len(setups) - 1) / 2) * width for i in range(len(names))]
        label = f"{n} router{'s' if n > 1 else ''}"
        label += f", {restarts} restart{'s' if restarts > 1 else ''}" if restarts else ""
        for ax, field, scale in ((axes[0], "engine_hit_rate", 100), (axes[1], "ttft_p99_ms", 1)):
            values = [
                [
                    r[field] * scale
                    for r in results
                    if r["policy"] == p and setup(r) == (n, restarts)
                ]
                for p in names
            ]
            means, low, high = _spread(values)
            edges = ["tab:red" if p == "kv_aware" else "black" for p in names]
            ax.bar(xs, means, width, yerr=[low, high], capsize=2, label=label, edgecolor=edges)
    ceilings = run.get("reuse_ceiling", {}).values()
    if ceilings:
        rate = statistics.mean(
            100 * c["cached_prompt_tokens"] / c["prompt_tokens"] for c in ceilings
        )
        axes[0].axhline(rate, color="tab:red", linestyle="--", linewidth=1, label="reuse ceiling")
    for ax in axes:
        ax.set_xticks(range(len(names)), names, rotation=35, fontsize=8)
    axes[0].set_ylabel("hit rate the engines report, % of prompt tokens")
    axes[1].set_ylabel("TTFT p99, ms")
    axes[0].legend(fontsize=8, loc="lower right")
    title = f"{run['workers']} vLLM CPU workers behind the control plane, tenants' traffic"
    return _save(fig, title, out / name)


def plot_seeds(files: Sequence[Path], out: Path) -> Path:
    """One router, no restart: each policy's hit rate seed by seed (`kv_summary.load`
    merges the files), with each seed's reuse ceiling."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, ceilings = kv_summary.load(files)
    runs = [r for r in runs if r.setup == (1, 0)]
    seeds = sorted({r.seed for r in runs})
    names = list(dict.fromkeys(r.policy for r in runs))
    rate = {(r.policy, r.seed): 100 * r.hit_rate for r in runs}
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(seeds) + 2), 4.2))
    width = 0.8 / max(len(names), 1)
    others = iter(
        ["tab:brown", "tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:olive"] * 2
    )
    for j, p in enumerate(names):
        xs = [i + (j - (len(names) - 1) / 2) * width for i, s in enumerate(seeds) if (p, s) in rate]
        ys = [rate[(p, s)] for s in seeds if (p, s) in rate]
        ax.bar(xs, ys, width, label=p, color="tab:red" if p == "kv_aware" else next(others))
    marks = [(i, 100 * ceilings[s]) for i, s in enumerate(seeds) if s in ceilings]
    if marks:
        ax.scatter(
            *zip(*marks, strict=True), marker="_", s=400, color="black", label="reuse ceiling"
        )
    low = min(rate.values(), default=0.0)
    ax.set_ylim(max(0.0, low - 5), None)
    ax.set_xticks(range(len(seeds)), [f"seed {s}" for s in seeds], fontsize=8)
    ax.set_ylabel("hit rate the engines report, %")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(True, axis="y", alpha=0.3)
    return _save(fig, "One router, seed by seed: real vLLM CPU workers", out / "seeds.png")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser("python -m bench.fleet.kv_plots", description=__doc__)
    ap.add_argument("--sim", type=Path, nargs="*", default=[])
    ap.add_argument("--rates", type=Path, nargs="*", default=[])
    ap.add_argument("--real", type=Path)
    ap.add_argument("--restart", type=Path, help="a kv_routing --restarts file")
    ap.add_argument(
        "--seeds", type=Path, nargs="*", default=[], help="kv_routing files: one router, by seed"
    )
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.sim:
        print(plot_sim(args.sim, args.out))
    if args.rates:
        print(plot_rates(args.rates, args.out))
    if args.real:
        print(plot_real(args.real, args.out))
    if args.restart:
        print(plot_real(args.restart, args.out, "restart.png"))
    if args.seeds:
        print(plot_seeds(args.seeds, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
