"""The control-plane process: the public gRPC server, health, reflection, and the
workers behind each model.

Order of life: listen at once (health NOT_SERVING), start or join the workers, load the
tokenizers, then SERVING per model. Shutdown: NOT_SERVING, `server.stop(grace)`, stop the
local workers, close the channels.
"""

from __future__ import annotations

import asyncio
import signal

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from switchyard.v1 import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc

from control.admin import AdminServicer
from control.config import ServeConfig
from control.lifecycle import ModelLoader, StartupError
from control.models import ModelRegistry
from control.servicer import GenerationServicer

log = structlog.get_logger(__name__)

GENERATION_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
ADMIN_SERVICE = admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class ControlPlane:
    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.registry = ModelRegistry()
        self.health = health.aio.HealthServicer()  # type: ignore[attr-defined]
        self.server = grpc.aio.server(
            options=[
                ("grpc.so_reuseport", 0),
                ("grpc.max_receive_message_length", 64 * 1024 * 1024),
            ]
        )
        self.loader = ModelLoader(self.registry, config.listen.rpartition(":")[0])
        self._model_status: dict[str, int] = {}
        self._health_task: asyncio.Task[None] | None = None
        self.port = 0

    async def start(self) -> None:
        generation_pb2_grpc.add_GenerationServicer_to_server(
            GenerationServicer(self.registry), self.server
        )
        admin_pb2_grpc.add_AdminServicer_to_server(
            AdminServicer(self.registry, self.loader), self.server
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (GENERATION_SERVICE, ADMIN_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME),
            self.server,
        )
        for name in ("", GENERATION_SERVICE, *(m.name for m in self.config.models)):
            await self.health.set(name, NOT_SERVING)
        # Until they are up, requests for configured models hear UNAVAILABLE ("loading").
        self.registry.loading.update(m.name for m in self.config.models)
        self.port = self.server.add_insecure_port(self.config.listen)
        if self.port == 0:
            raise StartupError(f"cannot listen on {self.config.listen}")
        await self.server.start()
        log.info("listening", address=self.config.listen, health="NOT_SERVING until ready")
        await asyncio.gather(*(self.loader.load(spec) for spec in self.config.models))
        await self._update_health()
        self._health_task = asyncio.create_task(self._health_loop(), name="model health")
        log.info("serving", address=self.config.listen, models=[m.name for m in self.config.models])

    async def _update_health(self) -> None:
        """Per model: SERVING while it has a healthy worker. Overall (and the Generation
        service): SERVING while any model does."""
        any_healthy = False
        for name in [n for n in self._model_status if n and self.registry.find(n) is None]:
            del self._model_status[name]  # unloaded
            await self.health.set(name, NOT_SERVING)
        for entry in self.registry.all():
            healthy = bool(entry.healthy_workers())
            any_healthy = any_healthy or healthy
            status = SERVING if healthy else NOT_SERVING
            if self._model_status.get(entry.name) != status:
                self._model_status[entry.name] = status
                await self.health.set(entry.name, status)
                log.info("model health", model=entry.name, serving=healthy)
        overall = SERVING if any_healthy else NOT_SERVING
        if self._model_status.get("") != overall:
            self._model_status[""] = overall
            for name in ("", GENERATION_SERVICE):
                await self.health.set(name, overall)

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            await self._update_health()

    async def stop(self, grace: float = 10.0) -> None:
        log.info("shutting down", grace_s=grace)
        if self._health_task is not None:
            self._health_task.cancel()
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
        await self.loader.stop_all()
        log.info("stopped")


async def serve(config: ServeConfig) -> int:
    plane = ControlPlane(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    start = asyncio.create_task(plane.start())
    stopper = asyncio.create_task(stop.wait())
    code = 0
    try:
        done, _ = await asyncio.wait({start, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if start in done:
            start.result()
            await stopper
        else:
            start.cancel()
    except (StartupError, OSError) as e:
        log.error("startup failed", error=str(e))
        code = 1
    finally:
        await plane.stop()
    return code
