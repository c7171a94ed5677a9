"""The models the control plane serves: each with its tokenizer, limits, admission,
routing policy and workers."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import structlog

from control.config import ModelSpec
from control.errors import ModelNotFound, NoHealthyWorker
from control.fleet.admission import Admission
from control.fleet.local_workers import LocalWorker
from control.fleet.shared_limits import LimitState
from control.metrics import ModelMetrics
from control.routing import IndexedPolicy, Policy, RouteRequest, default_policy, make_policy
from control.routing.kv_index import KvIndex
from control.text.params import ModelLimits
from control.text.tokenizer import Tokenizer
from control.workers.client import WorkerClient
from control.workers.state import WorkerInfo

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class ModelEntry:
    spec: ModelSpec
    tokenizer: Tokenizer
    info: WorkerInfo
    workers: list[WorkerClient] = field(default_factory=list)
    policy: Policy = field(init=False)
    admission: Admission = field(init=False)
    metrics: ModelMetrics = field(init=False)
    accepting: bool = True  # False while the model is being unloaded
    local: list[LocalWorker] = field(default_factory=list)  # processes started for it
    # The LoRA adapters it should hold (control/fleet/adapters.py): name -> AdapterSpec.
    adapters: dict[str, Any] = field(default_factory=dict)
    # A router process: asks the supervisor which worker holds what, now (an adapter
    # loaded since it last looked). None in the supervisor, which knows.
    refresh: Callable[[], Awaitable[None]] | None = None
    # Where its admission counts live: the service's shared state with `--routers N`
    # (control/fleet/shared_limits.py); None: its own.
    limit_state: LimitState | None = None

    def __post_init__(self) -> None:
        routing = self.spec.routing or default_policy(self.info.kv_events)
        if self.spec.kv_aware and routing != "kv_aware":
            log.warning(
                "kv_aware weights unused: the workers report no KV-cache events, so the "
                "default policy is least_load (set routing: kv_aware to use them)",
                model=self.spec.name,
            )
        self.policy = make_policy(
            routing, dict(self.spec.kv_aware) if routing == "kv_aware" else None
        )
        for w in self.workers:
            w.kv_sink = self.kv_index
        self.metrics = ModelMetrics(self.spec.name)
        self.admission = Admission(
            self.spec.name,
            self.spec.max_concurrency,
            self.spec.max_queue,
            self.metrics,
            self.limit_state,
        )

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def kv_index(self) -> KvIndex | None:
        """The index its routing reads, fed by its workers' KV-cache events (None: its
        policy follows no events)."""
        p = self.policy
        return p.index if isinstance(p, IndexedPolicy) and p.follows_events else None

    @property
    def limits(self) -> ModelLimits:
        return ModelLimits(max_context=self.info.max_context, vocab_size=self.info.vocab_size)

    def adapter_names(self) -> list[str]:
        """The adapters some worker of the model holds now."""
        return sorted({a for w in self.workers for a in w.adapters})

    def healthy_workers(self) -> list[WorkerClient]:
        return [w for w in self.workers if w.healthy]

    def pick_worker(
        self,
        request: RouteRequest,
        exclude: Collection[WorkerClient] = (),
        adapter: str = "",
        only: Callable[[WorkerClient], bool] | None = None,
    ) -> WorkerClient:
        """Health and circuit filtering (and, for an adapter, the workers that hold it;
        with `only`, the workers it accepts) first, then the model's policy."""
        candidates = [
            w
            for w in self.workers
            if w.healthy
            and w not in exclude
            and (not adapter or adapter in w.adapters)
            and (only is None or only(w))
        ]
        if not candidates:
            tried = f", {len(exclude)} already failed this request" if exclude else ""
            raise NoHealthyWorker(
                f"model {self.name!r} has no healthy worker "
                f"({len(self.healthy_workers())} of {len(self.workers)} healthy{tried})"
            )
        chosen = self.policy.choose(candidates, request)
        assert isinstance(chosen, WorkerClient)
        return chosen


class ModelRegistry:
    def __init__(self, limit_state: LimitState | None = None) -> None:
        self.limit_state = limit_state  # for its models' admission (None: each its own)
        self._models: dict[str, ModelEntry] = {}
        self.loading: set[str] = set()  # names whose workers are starting

    def add(self, entry: ModelEntry) -> None:
        self._models[entry.name] = entry

    def remove(self, name: str) -> ModelEntry | None:
        return self._models.pop(name, None)

    def get(self, name: str) -> ModelEntry:
        entry = self._models.get(name)
        if entry is None and name in self.loading:
            raise NoHealthyWorker(f"model {name!r} is still loading; retry shortly")
        if entry is None or not entry.accepting:
            raise ModelNotFound(name, sorted(n for n, e in self._models.items() if e.accepting))
        return entry

    def find(self, name: str) -> ModelEntry | None:
        return self._models.get(name)

    def all(self) -> list[ModelEntry]:
        return list(self._models.values())
