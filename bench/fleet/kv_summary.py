"""The real-worker routing runs (`bench.fleet.kv_routing --json`) summed up over their seeds:
per setup (routers, restarts), each policy's mean hit rate and range, how far below the
reuse ceiling, in how many seeds it was the highest, and each policy against `kv_aware`
seed by seed. Several files may be given (runs of one seed from another invocation, say);
for the same policy, seed and setup the later file's run counts.

    python -m bench.fleet.kv_summary results/kv-routing/real.json.xz \
        results/kv-routing/real-seeds.json.xz
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.results import read_json

Setup = tuple[int, int]  # routers, restarts


@dataclass(frozen=True, slots=True)
class Run:
    policy: str
    seed: int
    setup: Setup
    hit_rate: float


@dataclass(frozen=True, slots=True)
class Versus:
    """kv_aware against another policy on the seeds both ran."""

    seeds: int
    higher: int  # seeds where kv_aware's hit rate was higher
    tied: int
    mean_lead: float  # kv_aware's minus the other's, mean over those seeds


@dataclass(frozen=True, slots=True)
class Row:
    policy: str
    seeds: int
    mean: float
    low: float
    high: float
    below_ceiling: float  # mean, in points of hit rate
    highest_in: int  # seeds where no policy that ran the seed had more
    versus_kv: Versus | None  # None for kv_aware itself, or with no seed in common


def load(files: Iterable[Path]) -> tuple[list[Run], dict[int, float]]:
    """The runs of every file (the later file's for a repeated policy, seed and setup),
    and each seed's reuse ceiling as a hit rate."""
    runs: dict[tuple[str, int, Setup], Run] = {}
    ceilings: dict[int, float] = {}
    for f in files:
        data: dict[str, Any] = read_json(f)
        for seed, c in data.get("reuse_ceiling", {}).items():
            ceilings[int(seed)] = c["cached_prompt_tokens"] / c["prompt_tokens"]
        for r in data["results"]:
            setup = (int(r.get("routers", 1)), int(r.get("restarts", 0)))
            run = Run(r["policy"], int(r["seed"]), setup, float(r["engine_hit_rate"]))
            runs[(run.policy, run.seed, setup)] = run
    return list(runs.values()), ceilings


def summarize(runs: Sequence[Run], ceilings: Mapping[int, float]) -> dict[Setup, list[Row]]:
    """Per setup, one row per policy over the seeds it ran. "Highest" is among the
    policies that ran that seed, and a policy is set against `kv_aware` on the seeds both
    ran."""
    out: dict[Setup, list[Row]] = {}
    for setup in sorted({r.setup for r in runs}):
        mine = [r for r in runs if r.setup == setup]
        rate = {(r.policy, r.seed): r.hit_rate for r in mine}
        best: dict[int, float] = {}
        for r in mine:
            best[r.seed] = max(best.get(r.seed, 0.0), r.hit_rate)
        rows = []
        for p in dict.fromkeys(r.policy for r in mine):
            seeds = sorted(s for q, s in rate if q == p)
            values = [rate[(p, s)] for s in seeds]
            gaps = [ceilings[s] - rate[(p, s)] for s in seeds if s in ceilings]
            both = [s for s in seeds if ("kv_aware", s) in rate]
            versus = None
            if p != "kv_aware" and both:
                lead = [rate[("kv_aware", s)] - rate[(p, s)] for s in both]
                versus = Versus(
                    len(both),
                    sum(d > 0 for d in lead),
                    sum(d == 0 for d in lead),
                    statistics.mean(lead),
                )
            rows.append(
                Row(
                    policy=p,
                    seeds=len(seeds),
                    mean=statistics.mean(values),
                    low=min(values),
                    high=max(values),
                    below_ceiling=statistics.mean(gaps) if gaps else float("nan"),
                    highest_in=sum(rate[(p, s)] == best[s] for s in seeds),
                    versus_kv=versus,
                )
            )
        out[setup] = rows
    return out


def markdown(table: Mapping[Setup, Sequence[Row]]) -> str:
    lines: list[str] = []
    for (routers, restarts), rows in table.items():
        lines += [
            f"**{routers} router{'s' if routers > 1 else ''}, {restarts} restart"
            f"{'' if restarts == 1 else 's'}**",
            "",
            "| policy | seeds | mean hit rate | range | below the ceiling | highest in | "
            "kv_aware higher / tied / lower | kv_aware's mean lead |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            versus = lead = "-"
            if r.versus_kv is not None:
                v = r.versus_kv
                versus = f"{v.higher} / {v.tied} / {v.seeds - v.higher - v.tied}"
                lead = f"{100 * v.mean_lead:+.2f} points"
            lines.append(
                f"| {r.policy} | {r.seeds} | {r.mean:.1%} | {r.low:.1%} to {r.high:.1%} | "
                f"{100 * r.below_ceiling:.1f} points | {r.highest_in} of {r.seeds} | "
                f"{versus} | {lead} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser("python -m bench.fleet.kv_summary", description=__doc__)
    ap.add_argument("files", type=Path, nargs="+", help="bench.fleet.kv_routing --json files")
    args = ap.parse_args(argv)
    runs, ceilings = load(args.files)
    print(markdown(summarize(runs, ceilings)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
