"""LoRA adapters of the served models, held by the supervisor: loaded on every worker of
a model (Admin.LoadAdapter), put back on a worker that restarts or joins, and unloaded
once the requests using them are done (Admin.UnloadAdapter).

A model's `adapters` is what it should hold; each worker's `adapters` is what that
worker holds now, as far as this process knows, and routing sends a request naming an
adapter only to a worker that holds it. Router processes copy the workers' sets from
the supervisor's ListWorkers.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from dataclasses import dataclass

import structlog

from control.errors import (
    AdapterNotFound,
    AlreadyExists,
    FailedPrecondition,
    FieldViolation,
    InvalidArgument,
    NoHealthyWorker,
    NotFound,
    StatusError,
)
from control.fleet.models import ModelEntry, ModelRegistry
from control.workers.client import WorkerClient
from switchyard_common.names import ADAPTER_NAME, ADAPTER_NAME_RULE

log = structlog.get_logger(__name__)

SYNC_INTERVAL_S = 1.0  # how often a worker that lacks an adapter is given it


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    name: str
    path: str
    rank: int


class AdapterManager:
    """LoadAdapter, UnloadAdapter and ListAdapters over the registry's models."""

    def __init__(self, registry: ModelRegistry) -> None:
        self._registry = registry
        self._loading: set[tuple[str, str]] = set()

    async def load(self, model: str, name: str, path: str) -> tuple[AdapterSpec, float]:
        """Load on every serving worker of `model`; all or none. Loading the adapter it
        already holds under that name and path again is a no-op."""
        started = time.monotonic()
        entry = self._registry.get(model)
        violations = []
        if not ADAPTER_NAME.fullmatch(name):
            violations.append(FieldViolation("name", ADAPTER_NAME_RULE))
        if not path:
            violations.append(FieldViolation("path", "required: the adapter's directory"))
        if violations:
            raise InvalidArgument(violations)
        caps = entry.info.capabilities
        if caps is None or not caps.lora:
            raise FailedPrecondition(
                f"model {entry.name!r} ({entry.info.label}) has no LoRA: its engine was not "
                "started with it (vLLM: engine_args enable_lora, max_loras, max_lora_rank)",
                field="adapter",
            )
        held = entry.adapters.get(name)
        if held is not None:
            if held.path == path:
                return held, time.monotonic() - started
            raise AlreadyExists(f"model {model!r} holds adapter {name!r} from {held.path!r}")
        if (model, name) in self._loading:
            raise AlreadyExists(f"adapter {name!r} of model {model!r} is being loaded")
        workers = [w for w in entry.workers if w.serving]
        if not workers:
            raise NoHealthyWorker(f"model {model!r} has no serving worker to load it on")
        self._loading.add((model, name))
        done = False
        try:
            got = await asyncio.gather(
                *(w.load_adapter(name, path) for w in workers), return_exceptions=True
            )
            failed = [g for g in got if isinstance(g, BaseException)]
            if failed:
                raise failed[0]
            spec = AdapterSpec(name, path, max(g for g in got if isinstance(g, int)))
            entry.adapters[name] = spec
            for w in workers:
                if w.serving:  # one that restarted meanwhile lost it; the sync gives it back
                    w.adapters.add(name)
            done = True
        finally:
            self._loading.discard((model, name))
            if not done:  # all or none (also when the caller gave up): take it back off
                await asyncio.shield(
                    asyncio.gather(
                        *(w.unload_adapter(name, 0.0) for w in workers), return_exceptions=True
                    )
                )
        log.info("adapter loaded", model=model, adapter=name, path=path, workers=len(workers))
        return spec, time.monotonic() - started

    async def unload(self, model: str, name: str, grace_s: float) -> tuple[int, int]:
        """Stop routing to it at once; each worker waits up to `grace_s` for its
        requests, then cancels the rest. (drained, cancelled) over all workers."""
        if not math.isfinite(grace_s) or grace_s < 0:
            raise InvalidArgument([FieldViolation("grace_s", "must be a finite number >= 0")])
        entry = self._registry.get(model)
        if entry.adapters.pop(name, None) is None:
            raise AdapterNotFound(model, name, sorted(entry.adapters))
        # Every worker of the model: one whose holding this process lost track of (a health
        # blip clears it) may still hold it. Those that do not answer NOT_FOUND.
        workers = list(entry.workers)
        for w in workers:
            w.adapters.discard(name)
        got = await asyncio.gather(
            *(w.unload_adapter(name, grace_s) for w in workers), return_exceptions=True
        )
        drained = cancelled = 0
        for w, g in zip(workers, got, strict=True):
            if isinstance(g, NotFound):
                continue
            if isinstance(g, BaseException):  # a worker gone or restarting holds nothing
                log.warning("adapter unload failed", worker=w.address, adapter=name, error=str(g))
                continue
            drained += g[0]
            cancelled += g[1]
        log.info(
            "adapter unloaded", model=model, adapter=name, drained=drained, cancelled=cancelled
        )
        return drained, cancelled

    def listed(self, model: str = "") -> list[tuple[ModelEntry, AdapterSpec]]:
        entries = [self._registry.get(model)] if model else self._registry.all()
        return [(e, spec) for e in entries for spec in e.adapters.values()]

    async def sync_forever(self) -> None:
        """Give each serving worker the adapters its model holds and it lacks (a worker
        that restarted, or joined through DNS, holds none)."""
        while True:
            await asyncio.sleep(SYNC_INTERVAL_S)
            gives = [
                self._give(entry, w, spec)
                for entry in self._registry.all()
                for spec in list(entry.adapters.values())
                for w in entry.workers
                if w.serving and spec.name not in w.adapters
            ]
            await asyncio.gather(*gives)

    async def _give(self, entry: ModelEntry, w: WorkerClient, spec: AdapterSpec) -> None:
        try:
            await w.load_adapter(spec.name, spec.path, timeout=60.0)
        except Exception as e:  # a worker gone, closed or refusing: the next round retries
            log.warning("adapter not restored", worker=w.address, adapter=spec.name, error=str(e))
            return
        if entry.adapters.get(spec.name) is spec:  # not unloaded meanwhile
            w.adapters.add(spec.name)
            log.info("adapter restored", worker=w.address, adapter=spec.name)
        else:
            with contextlib.suppress(StatusError):
                await w.unload_adapter(spec.name, 0.0)
