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
from switchyard.v1 import generation_pb2, generation_pb2_grpc

from control.config import ModelSpec, ServeConfig
from control.models import ModelEntry, ModelRegistry
from control.servicer import GenerationServicer
from control.supervisor import LocalWorker, free_port, worker_command
from control.tinymodel import ensure_tiny_model
from control.tokenizer import Tokenizer
from control.worker_client import HealthPolicy, WorkerClient, WorkerInfo

log = structlog.get_logger(__name__)

GENERATION_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
WORKER_READY_TIMEOUT_S = 600.0
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class StartupError(RuntimeError):
    pass


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
        self.local_workers: list[LocalWorker] = []
        self._model_status: dict[str, int] = {}
        self._health_task: asyncio.Task[None] | None = None
        self.clients: list[WorkerClient] = []
        self.port = 0

    async def start(self) -> None:
        generation_pb2_grpc.add_GenerationServicer_to_server(
            GenerationServicer(self.registry), self.server
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (GENERATION_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server
        )
        for name in ("", GENERATION_SERVICE, *(m.name for m in self.config.models)):
            await self.health.set(name, NOT_SERVING)
        self.port = self.server.add_insecure_port(self.config.listen)
        if self.port == 0:
            raise StartupError(f"cannot listen on {self.config.listen}")
        await self.server.start()
        log.info("listening", address=self.config.listen, health="NOT_SERVING until ready")
        await asyncio.gather(*(self._load_model(spec) for spec in self.config.models))
        await self._update_health()
        self._health_task = asyncio.create_task(self._health_loop(), name="model health")
        log.info("serving", address=self.config.listen, models=[m.name for m in self.config.models])

    async def _update_health(self) -> None:
        """Per model: SERVING while it has a healthy worker. Overall (and the Generation
        service): SERVING while any model does."""
        any_healthy = False
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

    async def _load_model(self, spec: ModelSpec) -> None:
        model_path = spec.model
        if spec.is_builtin:
            model_path = str(await asyncio.to_thread(ensure_tiny_model))
        tokenizer = await asyncio.to_thread(Tokenizer, spec.tokenizer or model_path)
        addresses = list(spec.workers)
        starting: list[LocalWorker] = []
        if not addresses:
            host = self.config.listen.rpartition(":")[0] or "127.0.0.1"
            host = "127.0.0.1" if host in ("0.0.0.0", "[::]") else host
            for i in range(spec.replicas):
                port = free_port(host)
                cmd = worker_command(spec, model_path, port, tokenizer)
                lw = LocalWorker(f"{spec.name}-{i}", cmd, f"{host}:{port}")
                await lw.start()
                starting.append(lw)
                addresses.append(lw.address)
            self.local_workers += starting
        policy = HealthPolicy(
            canary_interval_s=spec.canary_interval_s,
            canary_timeout_s=spec.canary_timeout_s,
            failure_threshold=spec.failure_threshold,
        )
        clients = [WorkerClient(a, policy) for a in addresses]
        self.clients += clients
        log.info("loading model", model=spec.name, engine=spec.engine, workers=addresses)
        infos = await asyncio.gather(*(self._wait_worker(c, starting) for c in clients))
        info = infos[0]
        for other in infos[1:]:
            if (other.max_context, other.vocab_size) != (info.max_context, info.vocab_size):
                raise StartupError(f"model {spec.name}: workers disagree on context or vocabulary")
        if tokenizer.vocab_size > info.vocab_size:
            raise StartupError(
                f"model {spec.name}: tokenizer has {tokenizer.vocab_size} tokens but the model "
                f"only {info.vocab_size}"
            )
        self.registry.add(ModelEntry(spec=spec, tokenizer=tokenizer, info=info, workers=clients))
        await self.health.set(spec.name, SERVING)
        log.info("model ready", model=spec.name, engine=info.label, max_context=info.max_context)

    async def _wait_worker(self, client: WorkerClient, local: list[LocalWorker]) -> WorkerInfo:
        proc = next((lw for lw in local if lw.address == client.address), None)
        ready = asyncio.create_task(client.wait_ready(WORKER_READY_TIMEOUT_S))
        if proc is None or proc.proc is None:
            return await ready
        died = asyncio.create_task(proc.proc.wait())
        done, _ = await asyncio.wait({ready, died}, return_when=asyncio.FIRST_COMPLETED)
        if ready in done:
            died.cancel()
            return ready.result()
        ready.cancel()
        raise StartupError(
            f"worker {proc.name} exited with code {proc.exited} before it was ready "
            "(its log is above)"
        )

    async def stop(self, grace: float = 10.0) -> None:
        log.info("shutting down", grace_s=grace)
        if self._health_task is not None:
            self._health_task.cancel()
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
        await asyncio.gather(*(w.stop() for w in self.local_workers), return_exceptions=True)
        await asyncio.gather(*(c.close() for c in self.clients), return_exceptions=True)
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
