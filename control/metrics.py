"""The control plane's Prometheus metrics (`prometheus-client`), recorded always and
served on their own HTTP port when the config asks (`metrics: {listen: host:port}`).

Where vLLM has a metric for the same thing, the name is vLLM's with `switchyard_` for
`vllm:`, with its meaning, unit and buckets: `vllm:time_to_first_token_seconds` is
`switchyard_time_to_first_token_seconds`, and so on. They are measured here, in front of
every engine, so they read the same whichever engine answered; the engines' own load
(running, waiting, KV cache) comes from each worker's `StreamLoad` and is exported per
worker by `control.fleet.gauges` at scrape time.

Label children are looked up once per model (`ModelMetrics`), not per token.

With `--routers N` the supervisor's endpoint covers every process: router processes
write their values to files in a directory the supervisor gives them
(prometheus-client's multiprocess mode, switched on by `PROMETHEUS_MULTIPROC_DIR` in
their environment only), and the supervisor adds them to its own at each scrape
(`scrape_registry`). Workers never get that variable: vLLM reads it too.
"""

from __future__ import annotations

import asyncio
import os
from bisect import bisect_left
from collections.abc import Iterable
from typing import Any

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from prometheus_client.registry import Collector
from switchyard.v1 import generation_pb2

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
GENERATION_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
__all__ = [
    "BatchedHistogram",
    "ModelMetrics",
    "malformed_request",
    "mark_process_dead",
    "request_ended",
    "router_env",
    "sample_tasks",
    "scrape_registry",
]

# A `_created` series per counter doubles the output for a timestamp nobody queries.
disable_created_metrics()  # type: ignore[no-untyped-call]

# vLLM's buckets for the same histograms (vllm/v1/metrics/buckets.py), so that a
# dashboard's quantiles mean the same for both.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip

# Why a request's engine work was cut short (switchyard_request_cancellations_total).
CANCEL_CAUSES = ("client", "deadline", "stop_string", "failover")

REQUESTS = Counter(
    "switchyard_requests",
    "RPCs of the public API that ended, by model, RPC and gRPC status code.",
    ["model", "rpc", "code"],
)
REQUEST_SUCCESS = Counter(
    "switchyard_request_success",
    "Generations that ended with a Final, by finish reason (as vllm:request_success).",
    ["model", "finished_reason"],
)
TTFT = Histogram(
    "switchyard_time_to_first_token_seconds",
    "Time from receiving a request to its first token, in seconds.",
    ["model"],
    buckets=TTFT_BUCKETS,
)
ITL = Histogram(
    "switchyard_inter_token_latency_seconds",
    "Time between two tokens of a stream, in seconds (a chunk of k tokens after a gap g "
    "counts as one observation of g/k).",
    ["model"],
    buckets=ITL_BUCKETS,
)
FRONT_DIRECT_TOKENS = Counter(
    "switchyard_front_direct_tokens",
    "Streamed tokens whose public chunks the native front made itself from the worker's "
    "message (api.front: native), with no Python work per token.",
)
E2E = Histogram(
    "switchyard_e2e_request_latency_seconds",
    "Time from receiving a request to its Final, in seconds.",
    ["model"],
    buckets=REQUEST_LATENCY_BUCKETS,
)
QUEUE_TIME = Histogram(
    "switchyard_request_queue_time_seconds",
    "Time a request waited, in the control plane's admission queue and the engine's "
    "queue together, in seconds.",
    ["model"],
    buckets=REQUEST_LATENCY_BUCKETS,
)
PROMPT_TOKENS = Counter(
    "switchyard_prompt_tokens", "Prompt tokens of admitted requests.", ["model"]
)
GENERATION_TOKENS = Counter(
    "switchyard_generation_tokens", "Tokens generated and streamed to clients.", ["model"]
)
CACHED_PROMPT_TOKENS = Counter(
    "switchyard_prompt_tokens_cached",
    "Prompt tokens the engine found in its prefix cache.",
    ["model"],
)
CANCELLATIONS = Counter(
    "switchyard_request_cancellations",
    "Requests whose engine work was stopped early, by cause: the client went away, the "
    "deadline passed, a stop string matched, or the worker was ejected mid-stream.",
    ["model", "cause"],
)
ADMISSION_RUNNING = Gauge(
    "switchyard_admission_running",
    "Requests admitted and running, per model.",
    ["model"],
    multiprocess_mode="livesum",
)
ADMISSION_QUEUE = Gauge(
    "switchyard_admission_queue_depth",
    "Requests waiting in the admission queue, per model.",
    ["model"],
    multiprocess_mode="livesum",
)
ADMISSION_REJECTIONS = Counter(
    "switchyard_admission_rejections",
    "Requests refused with RESOURCE_EXHAUSTED because the admission queue was full.",
    ["model"],
)
FAILOVERS = Counter(
    "switchyard_failovers",
    "Worker attempts that failed and were retried on another worker, by failure kind.",
    ["model", "kind"],
)
RESUMES = Counter(
    "switchyard_resumes",
    "Failovers after the first token: another worker continued the stream.",
    ["model"],
)
EVENT_LOOP_TASKS = Gauge(
    "switchyard_event_loop_tasks",
    "asyncio tasks alive in the control plane's event loop (summed over its processes), "
    "sampled every second: flat under any traffic that has ended, or something leaks.",
    multiprocess_mode="livesum",
)
MALFORMED = Counter(
    "switchyard_malformed_requests",
    "Calls answered INVALID_ARGUMENT because their request body was not a valid encoding "
    "of the method's message, by full method name (a client's fault, counted also in "
    "switchyard_requests for the Generation service).",
    ["method"],
)


class ModelMetrics:
    """One model's label children, looked up once."""

    __slots__ = (
        "_cancel",
        "_failovers",
        "_finished",
        "_requests",
        "admission_queue",
        "admission_running",
        "cached_prompt_tokens",
        "e2e",
        "generation_tokens",
        "itl",
        "model",
        "prompt_tokens",
        "queue_time",
        "rejections",
        "resumes",
        "ttft",
    )

    def __init__(self, model: str) -> None:
        self.model = model
        self.ttft = TTFT.labels(model)
        self.itl = BatchedHistogram.of(ITL.labels(model), ITL_BUCKETS)
        self.e2e = E2E.labels(model)
        self.queue_time = QUEUE_TIME.labels(model)
        self.prompt_tokens = PROMPT_TOKENS.labels(model)
        self.generation_tokens = GENERATION_TOKENS.labels(model)
        self.cached_prompt_tokens = CACHED_PROMPT_TOKENS.labels(model)
        self.admission_running = ADMISSION_RUNNING.labels(model)
        self.admission_queue = ADMISSION_QUEUE.labels(model)
        self.rejections = ADMISSION_REJECTIONS.labels(model)
        self.resumes = RESUMES.labels(model)
        self._cancel = {cause: CANCELLATIONS.labels(model, cause) for cause in CANCEL_CAUSES}
        self._requests: dict[tuple[str, str], Any] = {}
        self._finished: dict[str, Any] = {}
        self._failovers: dict[str, Any] = {}
        for cause in CANCEL_CAUSES:  # present from the start, at 0, for rate() queries
            self._cancel[cause].inc(0)

    def cancelled(self, cause: str) -> None:
        self._cancel[cause].inc()

    def request_ended(self, rpc: str, code: str) -> None:
        request_ended(self.model, rpc, code, self._requests)

    def finished(self, reason: str) -> None:
        child = self._finished.get(reason)
        if child is None:
            child = self._finished[reason] = REQUEST_SUCCESS.labels(self.model, reason)
        child.inc()

    def failover(self, kind: str, resumed: bool) -> None:
        child = self._failovers.get(kind)
        if child is None:
            child = self._failovers[kind] = FAILOVERS.labels(self.model, kind)
        child.inc()
        if resumed:
            self.resumes.inc()


_UNKNOWN_MODEL_REQUESTS: dict[tuple[str, str], Any] = {}


def request_ended(
    model: str, rpc: str, code: str, cache: dict[tuple[str, str], Any] | None = None
) -> None:
    """Count one RPC. `model` must be a served model's name or "" (a name the client
    made up would grow the series without bound)."""
    cache = _UNKNOWN_MODEL_REQUESTS if cache is None else cache
    child = cache.get((rpc, code))
    if child is None:
        child = cache[(rpc, code)] = REQUESTS.labels(model, rpc, code)
    child.inc()


# A BatchedHistogram hands its observations on after this many, and at least every
# second (`sample_tasks`).
BATCH_OBSERVATIONS = 512
_BATCHED: dict[Any, BatchedHistogram] = {}  # by histogram child


class BatchedHistogram:
    """A histogram child observed once per streamed token: observations are counted here
    into its buckets, and added to the child in bulk. A histogram's `observe` takes a lock
    and increments two values (a file's, with `--routers N`) each time; per token that
    was 5% of a busy control plane's time on the CPU proxy (docs/results/profiles.md).

    Observed and flushed on the event loop's thread only. prometheus-client has no bulk
    observe, so the flush increments the child's own bucket and sum values."""

    __slots__ = ("_bounds", "_child", "_counts", "_n", "_sum")

    def __init__(self, child: Histogram, buckets: Iterable[float]) -> None:
        self._child = child
        self._bounds = (*buckets, float("inf"))
        if len(child._buckets) != len(self._bounds):
            raise ValueError("the buckets are not the histogram's")
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0
        self._n = 0

    @classmethod
    def of(cls, child: Histogram, buckets: Iterable[float]) -> BatchedHistogram:
        """The one BatchedHistogram of `child`."""
        batched = _BATCHED.get(child)
        if batched is None:
            batched = _BATCHED[child] = cls(child, buckets)
        return batched

    def observe(self, value: float) -> None:
        self._counts[bisect_left(self._bounds, value)] += 1
        self._sum += value
        self._n += 1
        if self._n >= BATCH_OBSERVATIONS:
            self.flush()

    def flush(self) -> None:
        if not self._n:
            return
        child: Any = self._child
        for bucket, count in zip(child._buckets, self._counts, strict=True):
            if count:
                bucket.inc(count)
        child._sum.inc(self._sum)
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0
        self._n = 0


def flush_batched() -> None:
    """Hand every BatchedHistogram's observations on to its histogram."""
    for batched in _BATCHED.values():
        batched.flush()


async def sample_tasks(every_s: float = 1.0) -> None:
    """Keep switchyard_event_loop_tasks current and the batched histograms flushed, until
    cancelled."""
    while True:
        EVENT_LOOP_TASKS.set(len(asyncio.all_tasks()))
        flush_batched()
        await asyncio.sleep(every_s)


def malformed_request(method: str) -> None:
    """Count a call whose body did not parse: a client error, of no model."""
    MALFORMED.labels(method).inc()
    service, _, rpc = method.rpartition("/")
    if service == f"/{GENERATION_SERVICE}":
        request_ended("", rpc, "INVALID_ARGUMENT")


class _Summed(Collector):
    """This process's metrics plus the router processes' (from their files): samples
    with the same name and labels are added up, so one family appears once."""

    def __init__(self, own: Collector, routers_dir: str) -> None:
        self._own = own
        self._routers = MultiProcessCollector(None, routers_dir)  # type: ignore[no-untyped-call]

    def collect(self) -> Iterable[Metric]:
        families: dict[str, Metric] = {}
        order: list[str] = []
        theirs = self._routers.collect()  # type: ignore[no-untyped-call]
        for family in [*self._own.collect(), *theirs]:
            seen = families.get(family.name)
            if seen is None:
                families[family.name] = family
                order.append(family.name)
                continue
            _add(seen, family)
        return [families[name] for name in order]


def _add(into: Metric, other: Metric) -> None:
    index = {(s.name, tuple(sorted(s.labels.items()))): i for i, s in enumerate(into.samples)}
    for sample in other.samples:
        key = (sample.name, tuple(sorted(sample.labels.items())))
        i = index.get(key)
        if i is None:
            index[key] = len(into.samples)
            into.samples.append(sample)
        elif sample.name.endswith("_created"):  # a start time, not a count: the earliest
            into.samples[i] = into.samples[i]._replace(
                value=min(into.samples[i].value, sample.value)
            )
        else:
            into.samples[i] = into.samples[i]._replace(value=into.samples[i].value + sample.value)


def router_env(routers_dir: str) -> dict[str, str]:
    """The environment of a router process whose metrics the supervisor serves."""
    return {**os.environ, MULTIPROC_ENV: routers_dir}


def scrape_registry(
    extra: Iterable[Collector] = (), routers_dir: str | None = None
) -> CollectorRegistry:
    """What the metrics endpoint serves: this process's metrics, with its router
    processes' added when they write theirs to `routers_dir`, and `extra` collectors
    read at scrape time."""
    registry = CollectorRegistry(auto_describe=False)
    own: Collector = REGISTRY if routers_dir is None else _Summed(REGISTRY, routers_dir)
    registry.register(own)
    for collector in extra:
        registry.register(collector)
    return registry
