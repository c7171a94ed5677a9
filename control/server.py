"""The control-plane process: the public gRPC server, health, reflection, and the
workers behind each model.

Order of life: listen at once (health NOT_SERVING), start or join the workers, load the
tokenizers, then SERVING per model. Shutdown: NOT_SERVING, `server.stop(grace)`, stop the
local workers, close the channels.

Listeners: grpc.aio accepts one new call at a time per server, and each accept waits for
a turn of the event loop. Behind a thousand streams, when every turn carries a message
for each of them, one server accepted new requests so slowly that they waited seconds
before being seen (TTFT p90 13 s on the H200, where the worker alone answered within
1 s). So the process runs `listeners` servers on its port (SO_REUSEPORT among
themselves; the kernel spreads client connections over them), each accepting on its own:
as many accepts per turn as there are listeners with new calls. A port that another
process serves is still refused first ("port in use").
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import secrets
import shutil
import signal
import tempfile
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import start_http_server
from switchyard.v1 import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc

from control import tracing
from control.api import front_lib
from control.api.admin import AdminServicer
from control.api.auth import AuthInterceptor, TokenStore
from control.api.front import HandlerTable, NativeFront
from control.api.front_lib import FrontLib
from control.api.generation import GenerationServicer
from control.config import ModelSpec, ServeConfig, TlsConfig
from control.fleet.adapters import AdapterManager
from control.fleet.gauges import FleetCollector
from control.fleet.lifecycle import ModelLoader, StartupError
from control.fleet.models import ModelRegistry
from control.fleet.router_processes import AdminForwarder, RouterPool
from control.fleet.shared_limits import LIMITS_FILE_ENV, SharedLimits
from control.metrics import malformed_request, sample_tasks, scrape_registry
from control.tracing import endpoint_from_env
from switchyard_common.health import HealthServicer
from switchyard_common.ports import bind, check_free
from switchyard_common.tls import server_credentials, server_pems
from switchyard_common.wire import Wire

log = structlog.get_logger(__name__)

GENERATION_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
ADMIN_SERVICE = admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name
DEFAULT_LISTENERS = 16
TOKENS_POLL_S = 1.0
LIVENESS_SERVICE = "liveness"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class ControlPlane:
    """One control-plane process: the supervisor (and first router), or, with
    `router_of`, one of the extra router processes it starts (see
    control/fleet/router_processes.py)."""

    def __init__(
        self,
        config: ServeConfig,
        *,
        routers: int = 1,
        router_of: str | None = None,
        ready_file: Path | None = None,
        listeners: int = DEFAULT_LISTENERS,
    ) -> None:
        self.config = config
        self.routers = routers
        self.router_of = router_of
        self.ready_file = ready_file
        # Limits that hold for the whole service: with routers, in a file they all map.
        self.limits = _shared_limits(routers, router_of)
        self.registry = ModelRegistry(self.limits)
        self.health = HealthServicer()
        listeners = max(1, listeners)
        native = _native_front(config.front)  # one grpc++ server: no listeners of its own
        self.shared_port = routers > 1 or router_of is not None or (listeners > 1 and not native)
        options = [
            ("grpc.so_reuseport", 1 if self.shared_port else 0),
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.max_send_message_length", config.max_message_bytes),
        ]
        # A bad tokens file fails the start here, naming it.
        try:
            self.tokens = (
                TokenStore(Path(config.tokens_file), self.limits) if config.tokens_file else None
            )
        except BaseException:
            self._close_limits()
            raise
        self._internal_token: str | None = None
        interceptors = [AuthInterceptor(self.tokens)] if self.tokens is not None else []
        if self.tokens is not None and routers > 1:
            self._internal_token = secrets.token_urlsafe(32)
            self.tokens.add_internal("switchyard-routers", self._internal_token)
        # api.front: native: the grpc++ front serves the public port, with these handlers.
        self.native = native
        self.interceptors = interceptors
        self.handlers = HandlerTable()
        self.front: NativeFront | None = None
        self.servers = [
            grpc.aio.server(options=options, interceptors=interceptors)
            for _ in range(0 if self.native else listeners)
        ]
        # Where the routers reach the supervisor's Admin: loopback, whether or not the
        # public port serves Admin, with the same token checks.
        self._private: grpc.aio.Server | None = None
        if routers > 1 and router_of is None:
            # Calls forwarded by a router were charged to their token's rate there.
            private_checks = (
                [AuthInterceptor(self.tokens, rate_limits=False)] if self.tokens else []
            )
            self._private = grpc.aio.server(interceptors=private_checks)
        self.pool: RouterPool | None = None
        self.forwarder: AdminForwarder | None = None
        self._background: set[asyncio.Task[None]] = set()
        self.otlp_endpoint = config.otlp_endpoint or endpoint_from_env()
        self.loader = ModelLoader(
            self.registry, config.listen.rpartition(":")[0], self.otlp_endpoint
        )
        self._model_status: dict[str, int] = {}
        self._health_task: asyncio.Task[None] | None = None
        self.port = 0
        self.metrics_port = 0  # where /metrics is served; 0: not served
        self._metrics_server: Any = None
        self._health_server: grpc.aio.Server | None = None
        self._metrics_dir: str | None = None  # the routers' metrics, when they have any
        # Every service registers through this: bodies that do not parse are the client's.
        self.wire = Wire(
            config.request_idle_s, config.max_metadata_bytes, on_malformed=malformed_request
        )

    async def start(self) -> None:
        if tracing.configure(self.otlp_endpoint, self.config.service_name):
            log.info("exporting traces", otlp_endpoint=self.otlp_endpoint)
        generation = GenerationServicer(self.registry, self.config.stream_interval)
        admin: admin_pb2_grpc.AdminServicer
        if self.router_of is not None:
            self.forwarder = admin = AdminForwarder(self.router_of)
        else:
            on_change = self._models_changed if self.routers > 1 else None
            adapters = AdapterManager(self.registry)
            admin = AdminServicer(self.registry, self.loader, on_change, adapters)
            self._spawn(adapters.sync_forever(), "adapter sync")
        services = [GENERATION_SERVICE, health.SERVICE_NAME]
        if self.config.admin:
            services.append(ADMIN_SERVICE)
        wire = self.wire
        targets: list[Any] = [*self.servers] if self.servers else [self.handlers]
        for server in targets:
            wire.add(server, generation_pb2_grpc.add_GenerationServicer_to_server, generation)
            if self.config.admin:
                wire.add(server, admin_pb2_grpc.add_AdminServicer_to_server, admin)
            wire.add(server, health_pb2_grpc.add_HealthServicer_to_server, self.health)
            if self.config.reflection:
                wire.add_reflection(server, services)
        for name in ("", GENERATION_SERVICE, *(m.name for m in self.config.models)):
            await self.health.set(name, NOT_SERVING)
        # For liveness probes: SERVING while this process serves gRPC at all, whatever
        # its models' state (readiness asks for a model's name).
        await self.health.set(LIVENESS_SERVICE, SERVING)
        # Until they are up, requests for configured models hear UNAVAILABLE ("loading").
        self.registry.loading.update(m.name for m in self.config.models)
        self._listen()
        private = ""
        if self.routers > 1:  # where the routers reach this process's Admin service
            assert self._private is not None
            wire.add(self._private, admin_pb2_grpc.add_AdminServicer_to_server, admin)
            private = f"127.0.0.1:{bind(self._private, '127.0.0.1:0')}"
            await self._private.start()
        for server in self.servers:
            await server.start()
        if self.front is not None:
            self.front.start()
        log.info("listening", address=self.config.listen, health="NOT_SERVING until ready")
        if self.config.metrics_listen and self.router_of is None:
            self._serve_metrics(self.config.metrics_listen)
        if self.config.health_listen and self.router_of is None:
            await self._serve_health(self.config.health_listen)
        await asyncio.gather(*(self.loader.load(spec) for spec in self.config.models))
        if self.routers > 1:  # SERVING once every process serves
            listen = f"{self.config.listen.rpartition(':')[0]}:{self.port}"
            self.pool = RouterPool(
                self.routers,
                self._router_shared(listen),
                private,
                max(1, len(self.servers)),
                self._metrics_dir,
                self._internal_token,
                self.limits,
            )
            await self.pool.start(self._models())
        await self._update_health()
        self._health_task = asyncio.create_task(self._health_loop(), name="model health")
        self._spawn(sample_tasks(), "count event-loop tasks")
        if self.tokens is not None:
            self._spawn(self._watch_tokens(), "watch tokens file")
        if self.forwarder is not None:
            self._spawn(self.forwarder.follow(self.registry), "follow supervisor")
        log.info(
            "serving",
            address=self.config.listen,
            models=[m.name for m in self.config.models],
            role="router" if self.router_of else "supervisor",
            processes=self.routers,
        )
        if self.ready_file is not None:
            self.ready_file.touch()

    def _listen(self) -> None:
        """Bind every listener to the configured address; refuse a port that another
        process serves (a router process joins its supervisor's port on purpose)."""
        host, _, port = self.config.listen.rpartition(":")
        if self.shared_port and self.router_of is None and port.isdigit():
            check_free(host, int(port))
        if self.native:
            lib = _front_lib(self.config, reuse_port=self.shared_port)
            self.front = NativeFront(lib, self.handlers.handlers, self.interceptors)
            self.port = lib.port
            return
        credentials = _server_credentials(self.config.tls)
        self.port = bind(self.servers[0], self.config.listen, credentials)
        for server in self.servers[1:]:
            bind(server, f"{host}:{self.port}", credentials)

    def _router_shared(self, listen: str) -> ServeConfig:
        """What the routers' config shares with this process's: the address as bound,
        api, tls, auth, and tracing to the endpoint this process found (in its config or
        in OTEL_*); not the metrics or health ports, which only this process serves."""
        return dataclasses.replace(
            self.config,
            listen=listen,
            models=(),
            metrics_listen=None,
            health_listen=None,
            otlp_endpoint=self.otlp_endpoint,
        )

    def reload_tokens(self) -> None:
        """SIGHUP: read the tokens file again, here and in every router."""
        if self.tokens is not None:
            self.tokens.reload()
        if self.pool is not None:
            self.pool.send_signal(signal.SIGHUP)

    async def _watch_tokens(self) -> None:
        """Reload the tokens file when it changes (a Kubernetes Secret is updated in place)."""
        assert self.tokens is not None
        while True:
            await asyncio.sleep(TOKENS_POLL_S)
            if self.tokens.changed():
                self.tokens.reload()

    async def _serve_health(self, listen: str) -> None:
        """grpc.health.v1 alone on a plaintext port: the same statuses as the public
        port's, for probes that cannot present TLS or a token."""
        self._health_server = grpc.aio.server()
        self.wire.add(
            self._health_server, health_pb2_grpc.add_HealthServicer_to_server, self.health
        )
        try:
            bind(self._health_server, listen)
        except OSError as e:
            raise OSError(f"health.listen {listen}: {e}") from e
        await self._health_server.start()
        log.info("health", address=listen)

    def _serve_metrics(self, listen: str) -> None:
        """Prometheus text at /metrics on its own port, from a thread of its own: this
        process's metrics, its routers' and the per-worker gauges."""
        if self.routers > 1:
            self._metrics_dir = tempfile.mkdtemp(prefix="switchyard-metrics-")
        registry = scrape_registry([FleetCollector(self.registry)], self._metrics_dir)
        host, _, port = listen.rpartition(":")
        try:
            self._metrics_server, _ = start_http_server(int(port), host.strip("[]"), registry)
        except OSError as e:
            raise OSError(f"metrics.listen {listen}: cannot listen: {e.strerror or e}") from e
        self.metrics_port = self._metrics_server.server_port
        log.info("metrics", url=f"http://{host}:{self.metrics_port}/metrics")

    def _models(self) -> list[tuple[ModelSpec, list[str]]]:
        return [(e.spec, [w.address for w in e.workers]) for e in self.registry.all()]

    def _models_changed(self) -> None:
        """The Admin API loaded or unloaded a model: the routers start over with the new
        set (in the background; the Admin call has its answer already)."""
        if self.pool is not None:
            self._spawn(self.pool.replace(self._models()), "replace routers")

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

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
        tasks = [*self._background]
        if self._health_task is not None:
            tasks.append(self._health_task)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.pool is not None:
            await self.pool.stop()
        if self.forwarder is not None:
            await self.forwarder.close()
        await self.health.enter_graceful_shutdown()
        await asyncio.gather(*(server.stop(grace) for server in self.servers))
        if self.front is not None:
            await self.front.stop(grace)
        if self._private is not None:
            await self._private.stop(grace)
        if self._health_server is not None:
            await self._health_server.stop(None)
        await self.loader.stop_all()
        if self._metrics_server is not None:
            await asyncio.to_thread(self._metrics_server.shutdown)
            self._metrics_server.server_close()
        if self._metrics_dir is not None:
            shutil.rmtree(self._metrics_dir, ignore_errors=True)
        self._close_limits()  # the supervisor's routers have stopped
        await asyncio.to_thread(tracing.shutdown)  # what is buffered goes out
        log.info("stopped")

    def _close_limits(self) -> None:
        """Close the shared limits; the supervisor, which created them, removes them."""
        if self.limits is None:
            return
        if self.router_of is None:
            self.limits.remove()
        else:
            self.limits.close()
        self.limits = None


def _shared_limits(routers: int, router_of: str | None) -> SharedLimits | None:
    """The supervisor of routers creates the shared limits; a router opens its
    supervisor's (OSError, naming the file, where it cannot)."""
    if router_of is None:
        return SharedLimits.create() if routers > 1 else None
    path = os.environ.get(LIMITS_FILE_ENV)
    return SharedLimits(Path(path)) if path else None


def _server_credentials(tls: TlsConfig | None) -> grpc.ServerCredentials | None:
    """TLS for the public port; with `client_ca`, mutual TLS."""
    if tls is None:
        return None
    return server_credentials(tls.cert, tls.key, tls.client_ca)


def _native_front(front: str) -> bool:
    """Whether the native front serves the public port: `api.front: auto` takes it where
    the build has it, and says so where it does not."""
    if front != "auto":
        return front == "native"
    reason = front_lib.unavailable()
    if reason is not None:
        log.warning("serving with grpc.aio: the native front is not available", reason=reason)
    return reason is None


def _front_lib(config: ServeConfig, reuse_port: bool) -> FrontLib:
    """The native front on the public port, with its TLS."""
    pems: tuple[bytes, bytes, bytes | None] = (b"", b"", None)
    if config.tls is not None:
        pems = server_pems(config.tls.cert, config.tls.key, config.tls.client_ca)
    cert, key, ca = pems
    return FrontLib(
        config.listen,
        reuse_port=reuse_port,
        max_message_bytes=config.max_message_bytes,
        # Room above api.max_metadata_bytes, so that the handlers' own check (Wire) is what
        # refuses a call over it, with RESOURCE_EXHAUSTED naming the limit.
        max_metadata_bytes=2 * config.max_metadata_bytes,
        cert_pem=cert,
        key_pem=key,
        client_ca_pem=ca or b"",
    )


async def serve(
    config: ServeConfig,
    *,
    routers: int = 1,
    router_of: str | None = None,
    ready_file: Path | None = None,
    listeners: int = DEFAULT_LISTENERS,
) -> int:
    try:
        plane = ControlPlane(
            config, routers=routers, router_of=router_of, ready_file=ready_file, listeners=listeners
        )
    except OSError as e:  # the shared limits file
        log.error("startup failed", error=str(e))
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, plane.reload_tokens)
    start = asyncio.create_task(plane.start())
    stopper = asyncio.create_task(stop.wait())
    code = 0
    try:
        done, _ = await asyncio.wait({start, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if start in done:
            start.result()
            await stopper
        else:
            # Asked to stop while models load: let the load clean up (stop the workers
            # it started) before the process goes, or they outlive it.
            start.cancel()
            await asyncio.gather(start, return_exceptions=True)
    except (StartupError, OSError, RuntimeError) as e:
        log.error("startup failed", error=str(e))
        code = 1
    finally:
        await plane.stop()
    return code
