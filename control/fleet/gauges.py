"""Per-worker gauges, read from the control plane's view of its fleet at each scrape.

Every worker reports its engine's load over `StreamLoad` (running and waiting requests,
KV-cache use and blocks, GPU memory), whatever the engine; this collector exports that
last report under one set of names, labelled by model, worker address and engine, so one
scrape of the control plane covers the whole fleet. Names follow vLLM's where vLLM has
the same gauge (`vllm:num_requests_running` is `switchyard_worker_num_requests_running`,
`vllm:kv_cache_usage_perc` is `switchyard_worker_kv_cache_usage_perc`, a fraction from
0 to 1).

It runs in the metrics server's thread while the event loop changes the fleet; it only
reads plain attributes and copies the lists it walks.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from control.fleet.models import ModelRegistry

# Every state a worker can be in (WorkerClient.state()): one series each, 1 for the
# current one, so that `switchyard_worker_state{state="open"} == 1` finds open circuits.
WORKER_STATES = ("closed", "open", "half_open", "draining", "not_serving")
_LABELS = ["model", "worker", "engine"]


class FleetCollector(Collector):
    def __init__(self, registry: ModelRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterable[Metric]:
        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=[*_LABELS, *extra])

        running = gauge(
            "switchyard_worker_num_requests_running",
            "Requests in the worker's engine batch, as its last StreamLoad report said.",
        )
        waiting = gauge(
            "switchyard_worker_num_requests_waiting",
            "Requests waiting in the worker's engine queue (StreamLoad).",
        )
        kv_usage = gauge(
            "switchyard_worker_kv_cache_usage_perc",
            "Fraction of the worker's KV cache in use, 0 to 1 (StreamLoad).",
        )
        kv_used = gauge(
            "switchyard_worker_kv_cache_blocks_used", "KV-cache blocks in use (StreamLoad)."
        )
        kv_free = gauge(
            "switchyard_worker_kv_cache_blocks_free", "KV-cache blocks free (StreamLoad)."
        )
        kv_total = gauge(
            "switchyard_worker_kv_cache_blocks_total", "KV-cache blocks in all (GetInfo)."
        )
        gpu_used = gauge(
            "switchyard_worker_gpu_memory_used_bytes",
            "GPU memory the worker's engine uses, in bytes (StreamLoad; 0 without a GPU).",
        )
        in_flight = gauge(
            "switchyard_worker_in_flight",
            "Requests this control plane has in flight on the worker.",
        )
        report_age = gauge(
            "switchyard_worker_load_report_age_seconds",
            "Seconds since the worker's last StreamLoad report (-1: none yet).",
        )
        state = gauge(
            "switchyard_worker_state",
            "1 for the worker's current state: closed (serving), open or half_open "
            "(circuit breaker), draining, not_serving.",
            ("state",),
        )
        now = time.monotonic()
        for entry in self._registry.all():
            for worker in list(entry.workers):
                info = worker.info
                labels = [entry.name, worker.address, info.engine if info else ""]
                load = worker.load
                running.add_metric(labels, load.running)
                waiting.add_metric(labels, load.waiting)
                kv_usage.add_metric(labels, load.kv_cache_usage)
                kv_used.add_metric(labels, load.kv_blocks_used)
                kv_free.add_metric(labels, load.kv_blocks_free)
                kv_total.add_metric(labels, info.kv_blocks_total if info else 0)
                gpu_used.add_metric(labels, load.gpu_memory_used_bytes)
                in_flight.add_metric(labels, worker.in_flight)
                report_age.add_metric(labels, now - load.updated if load.updated else -1.0)
                current = worker.state(peek=True)
                for s in WORKER_STATES:
                    state.add_metric([*labels, s], 1.0 if s == current else 0.0)
        return [
            running, waiting, kv_usage, kv_used, kv_free, kv_total, gpu_used, in_flight,
            report_age, state,
        ]  # fmt: skip
