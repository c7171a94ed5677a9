"""The native phases' tables (bench.gpu --phase native / native2 / native3), as markdown:

    python -m bench.gpu.native_report DIR      # DIR holds native.json, native2.json, native3.json

One row per system: tokens/s pass by pass, the mean, the engine's running requests and the
inter-token p50 (mean over passes), the CPU cores of the front's own processes; then each
pass's ratio against the worker (or both workers) of the same pass, and TTFT pairs.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any


def _runs(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for s in result.get("systems", []) for r in s.get("runs", [])]


def _running(run: dict[str, Any]) -> float | None:
    engines = run.get("engine") or {}
    means = [e["running_mean"] for e in engines.values() if "running_mean" in e]
    return sum(means) if means else None


def _split(run: dict[str, Any]) -> str:
    """Running requests per engine, where there are several: "505 / 382"."""
    engines = run.get("engine") or {}
    means = [e["running_mean"] for e in engines.values() if "running_mean" in e]
    return " / ".join(f"{m:.0f}" for m in means) if len(means) > 1 else ""


def _splits(runs: list[dict[str, Any]]) -> str:
    got = [_split(r) or "—" for r in runs]
    return f" ({'; '.join(got)})" if any(g != "—" for g in got) else ""


def _front_cores(run: dict[str, Any]) -> float | None:
    """Cores busy in the front's own processes (a control plane, a gateway, a server)."""
    busy = run.get("cores_busy", {})
    got = [v for k, v in busy.items() if k in ("control", "gateway", "server")]
    return sum(got) if got else None


def _by_label(runs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in runs:
        out[r["label"]].append(r)
    return out


def _fmt(x: float | None, digits: int = 0) -> str:
    return "—" if x is None else f"{x:,.{digits}f}"


def _mean(xs: list[float | None]) -> float | None:
    got = [x for x in xs if x is not None]
    return statistics.fmean(got) if got else None


def systems_table(runs: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| system | tokens/s, pass by pass | mean | running requests (engine) | "
        "inter-token p50 ms | TTFT p50 ms | CPU cores, front |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, rs in _by_label(runs).items():
        tput = [r["tokens_per_s"] for r in rs]
        parts = [p for r in rs for p in r.get("parts", [])]
        itl = _mean([r.get("itl_ms", {}).get("p50") for r in (parts or rs)])
        ttft = _mean([r.get("ttft_ms", {}).get("p50") for r in (parts or rs)])
        cores = _mean([_front_cores(r) for r in rs])
        lines.append(
            f"| {label} | {' / '.join(_fmt(t) for t in tput)} | {_fmt(statistics.fmean(tput))} "
            f"| {_fmt(_mean([_running(r) for r in rs]))}{_splits(rs)} | {_fmt(itl, 1)} "
            f"| {_fmt(ttft)} | {_fmt(cores, 2)} |"
        )
    return lines


def ratios(runs: list[dict[str, Any]], base: str) -> list[str]:
    """Each system's tokens/s over `base`'s in the same pass."""
    base_by_pass = {r.get("pass"): r["tokens_per_s"] for r in runs if r["label"] == base}
    lines = []
    for label, rs in _by_label(runs).items():
        if label == base:
            continue
        got = [
            r["tokens_per_s"] / base_by_pass[r["pass"]] for r in rs if r.get("pass") in base_by_pass
        ]
        if got:
            each = ", ".join(f"{g:.2f}" for g in got)
            lines.append(f"- {label} / {base}: {each} (mean {statistics.fmean(got):.2f})")
    return lines


def ttft(pairs: dict[str, Any], name: str) -> str:
    w, s, o = pairs["worker_ms"], pairs["switchyard_ms"], pairs["overhead_ms"]
    return (
        f"- TTFT, {int(pairs['pairs'])} single requests alternating, {name}: worker "
        f"{w['p50']:.2f} / {w['p99']:.2f} ms (p50 / p99), control plane {s['p50']:.2f} / "
        f"{s['p99']:.2f} ms: overhead **{o['p50']:+.2f} ms p50**, {o['p99']:+.2f} ms p99"
    )


def report(folder: Path) -> str:
    out: list[str] = []
    for phase, base in (
        ("native", "worker (GenerateStream)"),
        ("native2", "both workers directly, at once"),
        ("native3", "worker (GenerateStream)"),
    ):
        path = folder / f"{phase}.json"
        if not path.exists():
            continue
        result = json.loads(path.read_text())
        out += [f"### {phase}", ""]
        errors = [s for s in result["systems"] if "error" in s]
        out += [f"- failed: {s['label']}: {s['error']}" for s in errors]
        runs = _runs(result)
        out += [*systems_table(runs), "", *ratios(runs, base)]
        if phase == "native":
            asyncllm = [r["tokens_per_s"] for r in runs if r["label"] == "AsyncLLM in-process"]
            worker = [r["tokens_per_s"] for r in runs if r["label"] == base]
            if asyncllm and worker:
                out.append(
                    f"- worker / AsyncLLM (means): "
                    f"{statistics.fmean(worker) / statistics.fmean(asyncllm):.2f}"
                )
        for s in result["systems"]:
            pairs = s.get("ttft_pairs")
            if isinstance(pairs, dict) and "pairs" in pairs:
                out.append(ttft(pairs, "native front"))
            elif isinstance(pairs, dict):
                out += [ttft(p, name) for name, p in pairs.items()]
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(report(Path(sys.argv[1])))
