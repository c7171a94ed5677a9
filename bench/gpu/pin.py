"""Where the engine core runs: does its CPU set the fast engine's pace?

On the H200 the worker's engine, with the same settings, stat logger and batch of ~1000
as AsyncLLM's in-process engine, stepped about a third slower, and its engine-core
process was as busy: more CPU time per step, spread over every function alike, as a
slower CPU gives. A busy neighbour on the same physical core (its other hyperthread)
would do that. `Pinning` gives each engine core a physical core of its own and moves
every other process of the run (fronts, workers, load clients, this one) off those
cores, so the same engine can be measured both ways in one run.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from bench import systems


def physical_cores() -> list[list[int]]:
    """The CPUs this process may use, grouped by physical core (hyperthread siblings)."""
    allowed = os.sched_getaffinity(0)
    groups: dict[tuple[int, ...], list[int]] = {}
    for cpu in sorted(allowed):
        path = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        try:
            siblings = tuple(sorted(_cpu_list(path.read_text().strip()) & allowed))
        except OSError:
            siblings = (cpu,)
        groups.setdefault(siblings, list(siblings))
    return sorted(groups.values())


def _cpu_list(text: str) -> set[int]:
    out: set[int] = set()
    for part in text.split(","):
        if "-" in part:
            lo, hi = part.split("-")
            out.update(range(int(lo), int(hi) + 1))
        elif part:
            out.add(int(part))
    return out


def set_affinity(pid: int, cpus: set[int]) -> None:
    """Every thread of `pid` onto `cpus` (threads started later inherit it)."""
    for task in Path(f"/proc/{pid}/task").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(task.name), cpus)


class Pinning:
    """Engine cores on physical cores of their own; everything else on the rest."""

    def __init__(self, engine_cores: list[int], others: list[int]) -> None:
        self.engine_cores = engine_cores
        self.others = others
        self.cores = physical_cores()
        self.all = {c for core in self.cores for c in core}

    def describe(self) -> dict[str, object]:
        return {
            "physical_cores": len(self.cores),
            "logical_cpus": len(self.all),
            "siblings": self.cores[:2],
        }

    def pin(self) -> dict[str, list[int]]:
        """Returns where each engine core went."""
        if len(self.cores) <= len(self.engine_cores):
            return {}  # nothing left for the rest
        placed: dict[str, list[int]] = {}
        own: set[int] = set()
        for pid, core in zip(self.engine_cores, self.cores[-len(self.engine_cores) :], strict=True):
            set_affinity(pid, set(core))
            own |= set(core)
            placed[str(pid)] = core
        rest = self.all - own
        for pid in self._others():
            set_affinity(pid, rest)
        os.sched_setaffinity(0, rest)  # the load clients this process starts inherit it
        return placed

    def unpin(self) -> None:
        for pid in [*self.engine_cores, *self._others()]:
            set_affinity(pid, self.all)
        os.sched_setaffinity(0, self.all)

    def _others(self) -> list[int]:
        out: list[int] = []
        for pid in self.others:
            out.append(pid)
            out.extend(p for p in systems.descendants(pid) if p not in self.engine_cores)
        return out
