"""`switchyard.v1.Admin`: load and unload models at run time, list and drain workers."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NoReturn

import grpc
import structlog
from switchyard.v1 import admin_pb2, admin_pb2_grpc

from control.api.status import abort_rpc
from control.config import ConfigError, parse_model
from control.config_yaml import model_message_to_yaml
from control.errors import (
    AlreadyExists,
    FieldViolation,
    InvalidArgument,
    LoadFailed,
    NotFound,
    StatusError,
)
from control.fleet.adapters import AdapterManager, AdapterSpec
from control.fleet.lifecycle import ModelLoader
from control.fleet.models import ModelEntry, ModelRegistry
from control.workers.client import WorkerClient

log = structlog.get_logger(__name__)
Context = grpc.aio.ServicerContext[Any, Any]
DEFAULT_GRACE_S = 30.0


def worker_status(entry: ModelEntry, w: WorkerClient) -> admin_pb2.WorkerStatus:
    proc = next((lw for lw in entry.local if lw.address == w.address), None)
    return admin_pb2.WorkerStatus(
        address=w.address,
        model=entry.name,
        engine=w.info.label if w.info else "",
        serving=w.serving,
        circuit=w.breaker.state.value,
        draining=w.draining,
        routable=w.healthy,
        running=w.load.running,
        waiting=w.load.waiting,
        kv_cache_usage=w.load.kv_cache_usage,
        in_flight=w.in_flight,
        last_canary_ms=w.last_canary_ms or 0.0,
        local=proc is not None,
        process=proc.status if proc else "",
        restarts=proc.restarts if proc else 0,
        adapters=sorted(w.adapters),
        gpus=proc.gpus if proc else [],
        **_engine_shape(w),
    )


def _engine_shape(w: WorkerClient) -> dict[str, Any]:
    """What the worker's engine is and holds: its GetInfo, with its latest load report."""
    load = w.load
    shape: dict[str, Any] = {
        "kv_blocks_used": load.kv_blocks_used,
        "kv_blocks_free": load.kv_blocks_free,
        "gpu_memory_used_bytes": load.gpu_memory_used_bytes,
    }
    info = w.info
    if info is not None:
        shape.update(
            tensor_parallel_size=info.tensor_parallel_size,
            pipeline_parallel_size=info.pipeline_parallel_size,
            quantization=info.quantization,
            weight_dtype=info.weight_dtype,
            kv_cache_dtype=info.kv_cache_dtype,
            kv_block_size=info.kv_block_size,
            # A TensorRT-LLM worker knows its blocks only once the engine has stepped.
            kv_blocks_total=info.kv_blocks_total or load.kv_blocks_used + load.kv_blocks_free,
            gpu_memory_total_bytes=info.gpu_memory_total_bytes,
            max_context=info.max_context,
        )
    return shape


class AdminServicer(admin_pb2_grpc.AdminServicer):  # type: ignore[misc]
    def __init__(
        self,
        registry: ModelRegistry,
        loader: ModelLoader,
        on_change: Callable[[], None] | None = None,
        adapters: AdapterManager | None = None,
    ) -> None:
        self._registry = registry
        self._loader = loader
        self._on_change = on_change or (lambda: None)  # the set of models changed
        self._adapters = adapters or AdapterManager(registry)

    async def LoadModel(
        self, request: admin_pb2.LoadModelRequest, context: Context
    ) -> admin_pb2.LoadModelResponse:
        started = time.monotonic()
        try:
            try:
                spec = parse_model(model_message_to_yaml(request.spec), "spec")
            except ConfigError as e:
                raise InvalidArgument([FieldViolation(e.key, str(e))]) from e
            if self._registry.find(spec.name) or spec.name in self._loader.loading:
                raise AlreadyExists(f"model {spec.name!r} is already loaded")
            try:
                entry = await self._loader.load(spec)
            except Exception as e:  # the operator hears why, whatever broke
                raise LoadFailed(f"model {spec.name!r} failed to load: {e}") from e
        except StatusError as e:
            await _abort(context, e)
        self._on_change()
        return admin_pb2.LoadModelResponse(
            name=entry.name,
            workers=[worker_status(entry, w) for w in entry.workers],
            load_seconds=time.monotonic() - started,
        )

    async def UnloadModel(
        self, request: admin_pb2.UnloadModelRequest, context: Context
    ) -> admin_pb2.UnloadModelResponse:
        grace = request.grace_s if request.HasField("grace_s") else DEFAULT_GRACE_S
        try:
            result = await self._loader.unload(request.name, grace)
        except KeyError:
            await _abort(context, NotFound(f"model {request.name!r} is not loaded"))
        self._on_change()
        return admin_pb2.UnloadModelResponse(
            drained_requests=result.in_flight_at_start,
            cancelled_requests=result.left_after_grace,
        )

    async def ListWorkers(
        self, request: admin_pb2.ListWorkersRequest, context: Context
    ) -> admin_pb2.ListWorkersResponse:
        entries = self._registry.all()
        if request.model:
            entries = [e for e in entries if e.name == request.model]
            if not entries:
                await _abort(context, NotFound(f"model {request.model!r} is not loaded"))
        return admin_pb2.ListWorkersResponse(
            workers=[worker_status(e, w) for e in entries for w in e.workers]
        )

    async def DrainWorker(
        self, request: admin_pb2.DrainWorkerRequest, context: Context
    ) -> admin_pb2.DrainWorkerResponse:
        found = [(e, w) for e in self._registry.all() for w in e.workers]
        match = next(((e, w) for e, w in found if w.address == request.address), None)
        if match is None:
            await _abort(context, NotFound(f"no worker at {request.address!r}"))
        entry, worker = match
        grace = request.grace_s if request.HasField("grace_s") else DEFAULT_GRACE_S
        result = await self._loader.drain_worker(worker, grace)
        return admin_pb2.DrainWorkerResponse(
            worker=worker_status(entry, worker), in_flight_left=result.left_after_grace
        )

    async def LoadAdapter(
        self, request: admin_pb2.LoadAdapterRequest, context: Context
    ) -> admin_pb2.LoadAdapterResponse:
        try:
            spec, seconds = await self._adapters.load(request.model, request.name, request.path)
            entry = self._registry.get(request.model)
        except StatusError as e:
            await _abort(context, e)
        return admin_pb2.LoadAdapterResponse(adapter=_adapter(entry, spec), load_seconds=seconds)

    async def UnloadAdapter(
        self, request: admin_pb2.UnloadAdapterRequest, context: Context
    ) -> admin_pb2.UnloadAdapterResponse:
        grace = request.grace_s if request.HasField("grace_s") else DEFAULT_GRACE_S
        try:
            drained, cancelled = await self._adapters.unload(request.model, request.name, grace)
        except StatusError as e:
            await _abort(context, e)
        return admin_pb2.UnloadAdapterResponse(
            drained_requests=drained, cancelled_requests=cancelled
        )

    async def ListAdapters(
        self, request: admin_pb2.ListAdaptersRequest, context: Context
    ) -> admin_pb2.ListAdaptersResponse:
        try:
            listed = self._adapters.listed(request.model)
        except StatusError as e:
            await _abort(context, e)
        return admin_pb2.ListAdaptersResponse(adapters=[_adapter(e, s) for e, s in listed])


def _adapter(entry: ModelEntry, spec: AdapterSpec) -> admin_pb2.Adapter:
    holders = [w for w in entry.workers if spec.name in w.adapters]
    return admin_pb2.Adapter(
        model=entry.name,
        name=spec.name,
        path=spec.path,
        rank=spec.rank,
        workers=[w.address for w in holders],
        in_flight=sum(1 for w in holders for c in w.calls if c.adapter == spec.name),
    )


async def _abort(context: Context, err: StatusError) -> NoReturn:
    log.info("admin request failed", error=str(err))
    await abort_rpc(context, err)
