"""Time to first token, one request at a time, several targets alternating request by
request: the probe behind the TTFT-overhead target (bench.cpu.compare and the GPU fronts).
"""

from __future__ import annotations

from collections.abc import Callable

import structlog

from bench.load.loadgen import Target, Workload, one_request

log = structlog.get_logger(__name__)


async def ttft_probe(
    factories: list[Callable[[], Target]], requests: int, prompt_len: int, seed: int = 7
) -> dict[str, dict[str, float]]:
    """Time to first token, one request at a time, the targets alternating request by
    request (so both see the same moments of a noisy machine): p50 and p99 over many
    samples, for the TTFT-overhead target. Each target gets prompts of its own: where the
    targets share an engine, a prompt the other just sent would hit its prefix cache."""
    targets = [make() for make in factories]
    work = Workload(
        requests=requests * len(targets),
        prompt_len=(prompt_len, prompt_len),
        output_len=(2, 2),
        seed=seed,
    ).items()
    samples: dict[str, list[float]] = {t.name: [] for t in targets}
    for i in range(requests):
        order = list(enumerate(targets)) if i % 2 == 0 else list(reversed(list(enumerate(targets))))
        for j, t in order:
            prompt, n = work[i * len(targets) + j]
            rec = await one_request(t, prompt, n)
            if rec.error is None and rec.ttft is not None:
                samples[t.name].append(rec.ttft * 1000)
    for t in targets:
        await t.close()
    out = {}
    for name, values in samples.items():
        values.sort()
        out[name] = {
            "p50": values[len(values) // 2],
            "p99": values[min(len(values) - 1, round(0.99 * (len(values) - 1)))],
            "samples": float(len(values)),
        }
    log.info("ttft probe", **{k: round(v["p50"], 2) for k, v in out.items()})
    return out
