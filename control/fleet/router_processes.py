"""Router processes: `switchyard serve --routers N`.

One control-plane process may not keep up with the per-token work of many engines, so
the supervisor process (engine loading, health, Admin) starts N-1 more router processes
that listen on the same port (SO_REUSEPORT; the kernel spreads connections across them).
A router keeps no state but its own view of the workers: it joins the supervisor's
workers by address, watches their health and load itself, forwards Admin calls to the
supervisor, and follows worker drains from the supervisor's `ListWorkers`. When the set
of models changes (LoadModel, UnloadModel), the supervisor replaces its routers: new
ones start before the old ones drain and stop.

Limits hold for the whole service, not per process: the supervisor creates a small
shared file (control/fleet/shared_limits.py) that every process maps, in a private
temporary directory, and hands its path to its routers in `LIMITS_FILE_ENV`. A token's
rate buckets and a model's admission counts (`limits`) live there, under a file lock, so
N processes together admit what one would. Each process's share of the running and
queued counts is kept apart: when a router exits (or dies, SIGKILL included), the
supervisor gives back what it still held.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import structlog
from switchyard.v1 import admin_pb2, admin_pb2_grpc

from control.config import ModelSpec, ServeConfig
from control.config_yaml import dump_config
from control.fleet.local_workers import LocalWorker
from control.fleet.models import ModelRegistry
from control.fleet.shared_limits import LIMITS_FILE_ENV, SharedLimits
from control.metrics import mark_process_dead, router_env

log = structlog.get_logger(__name__)

ROUTER_READY_TIMEOUT_S = 120.0
INTERNAL_TOKEN_ENV = "SWITCHYARD_INTERNAL_TOKEN"
FOLLOW_INTERVAL_S = 1.0
_DEFAULT_DNS_INTERVAL_S = ModelSpec(name="", engine="", model="").dns_interval_s


def router_config(
    shared: ServeConfig, models: Sequence[tuple[ModelSpec, Sequence[str]]]
) -> ServeConfig:
    """A router's config: the sections it shares with the supervisor (`shared`: the
    address it listens on, api, tracing, tls, auth), and the supervisor's models joined by
    their workers' addresses (a router starts no worker of its own)."""
    routed = []
    for spec, addresses in models:
        routed.append(
            dataclasses.replace(
                spec,
                # Workers behind a name come and go: each router follows the name itself.
                workers=spec.workers if spec.dns else tuple(addresses),
                dns_interval_s=spec.dns_interval_s if spec.dns else _DEFAULT_DNS_INTERVAL_S,
                replicas=1,
                engine_args={},
                gpus=(),
            )
        )
    return dataclasses.replace(shared, models=tuple(routed))


class RouterPool:
    """The supervisor's extra router processes."""

    def __init__(
        self,
        count: int,
        shared: ServeConfig,
        supervisor: str,
        listeners: int = 1,
        metrics_dir: str | None = None,
        internal_token: str | None = None,
        limits: SharedLimits | None = None,
    ) -> None:
        self.count = count
        # What every router's config shares with the supervisor's: the address it
        # listens on (as bound), api, tracing, tls, auth (`router_config`).
        self.shared = shared
        self.listen = shared.listen
        self.listeners = listeners  # each router's, as the supervisor's
        self.supervisor = supervisor  # the supervisor's private address, for Admin
        # Where the routers write their metrics for the supervisor's endpoint, if it has one.
        self.metrics_dir = metrics_dir
        self.internal_token = internal_token  # the routers' own admin token, if auth is on
        self.limits = limits  # the limits every process shares
        self._dir = Path(tempfile.mkdtemp(prefix="switchyard-routers-"))
        self._routers: list[LocalWorker] = []
        self._generation = 0
        self._lock = asyncio.Lock()

    async def start(self, models: Sequence[tuple[ModelSpec, Sequence[str]]]) -> None:
        async with self._lock:
            self._routers = await self._spawn(models)

    async def replace(self, models: Sequence[tuple[ModelSpec, Sequence[str]]]) -> None:
        """New routers for a new set of models; the old ones drain, then stop."""
        async with self._lock:
            old = self._routers
            self._routers = await self._spawn(models)
            await self._stop(old)

    def send_signal(self, sig: int) -> None:
        """Pass a signal on to every router (SIGHUP: reload the tokens file)."""
        for router in self._routers:
            if router.proc is not None and router.proc.returncode is None:
                router.proc.send_signal(sig)

    async def stop(self) -> None:
        async with self._lock:
            await self._stop(self._routers)
            self._routers = []

    def _router_exited(self, pid: int) -> None:
        """A router exited (and may be restarted under a new pid): its gauges leave the
        sums, its counters stay, and the admission slots it still held go back."""
        if self.metrics_dir is not None:
            mark_process_dead(pid, self.metrics_dir)  # type: ignore[no-untyped-call]
        if self.limits is not None:
            held = self.limits.reclaim(pid)
            if any(held.values()):
                log.warning("admission slots of an exited router given back", pid=pid, **held)

    async def _stop(self, routers: list[LocalWorker]) -> None:
        # Those that exited before were seen by their watch (`_router_exited`).
        running = [r.proc for r in routers if r.proc is not None and r.proc.returncode is None]
        await asyncio.gather(*(r.stop() for r in routers), return_exceptions=True)
        for proc in running:
            if proc.returncode is not None:
                self._router_exited(proc.pid)

    async def _spawn(self, models: Sequence[tuple[ModelSpec, Sequence[str]]]) -> list[LocalWorker]:
        self._generation += 1
        config = self._dir / f"routers-{self._generation}.yaml"
        config.write_text(dump_config(router_config(self.shared, models)))
        routers = []
        ready_files = []
        for i in range(1, self.count):
            ready = self._dir / f"ready-{self._generation}-{i}"
            cmd = [
                sys.executable, "-m", "control", "serve", "--config", str(config),
                "--router-of", self.supervisor, "--ready-file", str(ready),
                "--listeners", str(self.listeners),
            ]  # fmt: skip
            env = router_env(self.metrics_dir) if self.metrics_dir is not None else None
            if self.internal_token is not None:
                env = {**(env or os.environ), INTERNAL_TOKEN_ENV: self.internal_token}
            if self.limits is not None:
                env = {**(env or os.environ), LIMITS_FILE_ENV: str(self.limits.path)}
            router = LocalWorker(
                f"router-{i}", cmd, self.listen, env=env, on_exit=self._router_exited
            )
            await router.start()
            routers.append(router)
            ready_files.append(ready)
        started = time.monotonic()
        while not all(f.exists() for f in ready_files):
            if time.monotonic() - started > ROUTER_READY_TIMEOUT_S:
                await asyncio.gather(*(r.stop() for r in routers), return_exceptions=True)
                raise RuntimeError(f"router processes not ready after {ROUTER_READY_TIMEOUT_S} s")
            await asyncio.sleep(0.1)
        log.info("routers serving", processes=self.count, listen=self.listen)
        return routers


class AdminForwarder(admin_pb2_grpc.AdminServicer):  # type: ignore[misc]
    """A router's Admin service: every call goes to the supervisor, which owns the
    workers, and its answer (or error, with details) comes back unchanged."""

    def __init__(self, supervisor: str) -> None:
        # With authentication on, the supervisor gave this router a token of its own
        # for its own calls (following drains), in its environment.
        secret = os.environ.get(INTERNAL_TOKEN_ENV)
        self._own_token = [("authorization", f"Bearer {secret}")] if secret else []
        self._channel = grpc.aio.insecure_channel(supervisor)
        self._stub = admin_pb2_grpc.AdminStub(self._channel)

    async def _forward(self, method: Callable[..., Any], request: Any, context: Any) -> Any:
        # The caller's token and trace go along: the supervisor checks the token itself.
        metadata = [
            (k, v)
            for k, v in context.invocation_metadata() or ()
            if k in ("authorization", "traceparent", "tracestate")
        ]
        try:
            return await method(request, timeout=context.time_remaining(), metadata=metadata)
        except grpc.aio.AioRpcError as e:
            await context.abort(e.code(), e.details() or "", e.trailing_metadata() or None)

    async def LoadModel(self, request: Any, context: Any) -> Any:
        return await self._forward(self._stub.LoadModel, request, context)

    async def UnloadModel(self, request: Any, context: Any) -> Any:
        return await self._forward(self._stub.UnloadModel, request, context)

    async def ListWorkers(self, request: Any, context: Any) -> Any:
        return await self._forward(self._stub.ListWorkers, request, context)

    async def DrainWorker(self, request: Any, context: Any) -> Any:
        return await self._forward(self._stub.DrainWorker, request, context)

    async def LoadAdapter(self, request: Any, context: Any) -> Any:
        return await self._forward(self._stub.LoadAdapter, request, context)

    async def UnloadAdapter(self, request: Any, context: Any) -> Any:
        return await self._forward(self._stub.UnloadAdapter, request, context)

    async def ListAdapters(self, request: Any, context: Any) -> Any:
        return await self._forward(self._stub.ListAdapters, request, context)

    async def follow(self, registry: ModelRegistry) -> None:
        """Mirror the supervisor's worker drains and adapters into this router's view;
        a request for an adapter this router has not seen yet asks at once (`refresh`)."""
        for entry in registry.all():
            entry.refresh = lambda: self.refresh(registry)
        while True:
            await asyncio.sleep(FOLLOW_INTERVAL_S)
            await self.refresh(registry)

    async def refresh(self, registry: ModelRegistry) -> None:
        try:
            listed = await self._stub.ListWorkers(
                admin_pb2.ListWorkersRequest(), timeout=5, metadata=self._own_token
            )
        except grpc.aio.AioRpcError as e:
            log.warning("supervisor unreachable", code=e.code().name)
            return
        seen = {(w.model, w.address): w for w in listed.workers}
        for entry in registry.all():
            for worker in entry.workers:
                status = seen.get((entry.name, worker.address))
                worker.draining = status is not None and status.draining
                worker.adapters = set(status.adapters) if status is not None else set()

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self._channel.close(None)
