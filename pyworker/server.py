"""The worker's gRPC server: the Worker service, grpc.health.v1 and server reflection.

`serve()` starts the server around an engine that is already built, reports SERVING,
and on a stop request (SIGTERM, SIGINT, or a dead engine) goes NOT_SERVING first and
then stops the server with a grace period. The caller shuts the engine down after.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import signal

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from switchyard.worker.v1 import worker_pb2, worker_pb2_grpc

from pyworker.engine import Engine
from pyworker.servicer import WorkerServicer
from switchyard_common.health import HealthServicer
from switchyard_common.ports import NO_REUSEPORT, Reservation, bind
from switchyard_common.wire import DEFAULT_REQUEST_IDLE_S, Wire

log = structlog.get_logger(__name__)

WORKER_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
HEALTH_SERVICES = ("", WORKER_SERVICE)
DEFAULT_GRACE_S = 5.0
_ENGINE_CHECK_S = 1.0


class StopReason(enum.Enum):
    SIGNAL = "signal"
    ENGINE_DEAD = "engine dead"
    REQUESTED = "requested"


def listen_address(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


class WorkerServer:
    """One grpc.aio server for one engine."""

    def __init__(
        self,
        engine: Engine,
        host: str,
        port: int,
        credentials: grpc.ServerCredentials | None = None,
        request_idle_s: float = DEFAULT_REQUEST_IDLE_S,
    ) -> None:
        self._engine = engine
        self._address = listen_address(host, port)
        self._credentials = credentials  # TLS, or None: plaintext
        self._server = grpc.aio.server(options=[NO_REUSEPORT])
        self._health = HealthServicer()
        self.servicer = WorkerServicer(engine)
        self.port = 0
        self._stop = asyncio.Event()
        self._stop_reason = StopReason.REQUESTED

        wire = Wire(request_idle_s)
        wire.add(self._server, worker_pb2_grpc.add_WorkerServicer_to_server, self.servicer)
        wire.add(self._server, health_pb2_grpc.add_HealthServicer_to_server, self._health)
        wire.add_reflection(
            self._server,
            (WORKER_SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name),
        )

    async def start(self, reservation: Reservation | None = None) -> int:
        for name in HEALTH_SERVICES:
            await self._health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        if reservation is not None:
            reservation.release()  # held while the engine started; bound again at once
        self.port = bind(self._server, self._address, self._credentials)
        await self._server.start()
        if self.servicer.kv_events is not None:
            self.servicer.kv_events.start_once()
        for name in HEALTH_SERVICES:
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("serving on", address=self._address, port=self.port)
        return self.port

    def request_stop(self, reason: StopReason = StopReason.REQUESTED) -> None:
        if not self._stop.is_set():
            self._stop_reason = reason
            self._stop.set()

    async def wait(self) -> StopReason:
        """Serve until asked to stop or the engine dies; return why."""
        watchdog = asyncio.create_task(self._watch_engine())
        try:
            await self._stop.wait()
        finally:
            watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watchdog
        return self._stop_reason

    async def stop(self, grace_s: float = DEFAULT_GRACE_S) -> None:
        """NOT_SERVING, then stop the server, letting calls in flight finish for grace_s."""
        await self._health.enter_graceful_shutdown()
        log.info("stopping server", grace_s=grace_s, in_flight=self.servicer.in_flight)
        await self._server.stop(grace_s)
        log.info("server stopped")

    async def _watch_engine(self) -> None:
        while True:
            await asyncio.sleep(_ENGINE_CHECK_S)
            if self._engine.errored:
                log.error("engine is dead; going NOT_SERVING")
                self.request_stop(StopReason.ENGINE_DEAD)
                return


_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def install_signal_handlers(server: WorkerServer) -> None:
    loop = asyncio.get_running_loop()
    for sig in _SIGNALS:
        loop.add_signal_handler(sig, _on_signal, server, sig)


def remove_signal_handlers() -> None:
    loop = asyncio.get_running_loop()
    for sig in _SIGNALS:
        loop.remove_signal_handler(sig)


def _on_signal(server: WorkerServer, sig: signal.Signals) -> None:
    log.info("shutdown requested", signal=sig.name)
    server.request_stop(StopReason.SIGNAL)


async def serve(
    engine: Engine,
    host: str,
    port: int,
    grace_s: float = DEFAULT_GRACE_S,
    reservation: Reservation | None = None,
    credentials: grpc.ServerCredentials | None = None,
    request_idle_s: float = DEFAULT_REQUEST_IDLE_S,
) -> StopReason:
    """Serve `engine` until SIGTERM/SIGINT or engine death. The engine stays up."""
    server = WorkerServer(engine, host, port, credentials, request_idle_s)
    install_signal_handlers(server)
    try:
        await server.start(reservation)
        try:
            return await server.wait()
        finally:
            await server.stop(grace_s)
    finally:
        remove_signal_handlers()
