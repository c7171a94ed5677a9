"""The models the control plane serves: each with its tokenizer, limits and workers."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from control.config import ModelSpec
from control.errors import ModelNotFound, NoHealthyWorker
from control.params import ModelLimits
from control.tokenizer import Tokenizer
from control.worker_client import WorkerClient, WorkerInfo


@dataclass(slots=True)
class ModelEntry:
    spec: ModelSpec
    tokenizer: Tokenizer
    info: WorkerInfo
    workers: list[WorkerClient] = field(default_factory=list)
    _rr: itertools.count[int] = field(default_factory=itertools.count)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def limits(self) -> ModelLimits:
        return ModelLimits(max_context=self.info.max_context, vocab_size=self.info.vocab_size)

    def healthy_workers(self) -> list[WorkerClient]:
        return [w for w in self.workers if w.healthy]

    def pick_worker(self) -> WorkerClient:
        """Least in-flight requests among healthy workers, round-robin on ties."""
        healthy = self.healthy_workers()
        if not healthy:
            raise NoHealthyWorker(
                f"model {self.name!r} has no healthy worker ({len(self.workers)} configured)"
            )
        start = next(self._rr) % len(healthy)
        rotated = healthy[start:] + healthy[:start]
        return min(rotated, key=lambda w: w.in_flight)


class ModelRegistry:
    def __init__(self) -> None:
        self._models: dict[str, ModelEntry] = {}

    def add(self, entry: ModelEntry) -> None:
        self._models[entry.name] = entry

    def get(self, name: str) -> ModelEntry:
        entry = self._models.get(name)
        if entry is None:
            raise ModelNotFound(name, sorted(self._models))
        return entry

    def all(self) -> list[ModelEntry]:
        return list(self._models.values())
