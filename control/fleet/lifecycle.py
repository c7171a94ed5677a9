"""Model lifecycle: start or join a model's workers and wait until they serve; drain and
stop them; follow a DNS name for workers that come and go.

Used at start-up for the configured models and by the Admin API at run time.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from control.config import ModelSpec
from control.fleet.local_workers import (
    LocalWorker,
    free_port,
    termination_log_path,
    worker_command,
)
from control.fleet.models import ModelEntry, ModelRegistry
from control.text.tokenizer import Tokenizer
from control.workers import health
from control.workers.client import WorkerClient
from control.workers.health import HealthPolicy
from control.workers.state import WorkerInfo
from switchyard_common.tinymodel import ensure_tiny_model
from switchyard_common.tls import channel_credentials

log = structlog.get_logger(__name__)

WORKER_READY_TIMEOUT_S = 600.0
REMOTE_READY_TIMEOUT_S = 120.0
# How long a model that routes from KV-cache events waits, as it loads, for its workers'
# snapshots (what their engines hold) before it routes without them.
KV_SYNC_TIMEOUT_S = 2.0


class StartupError(RuntimeError):
    pass


def root_cause(exc: BaseException) -> BaseException:
    """The first real error inside task-group wrappers: what an operator needs to read."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


@dataclass(frozen=True, slots=True)
class DrainResult:
    in_flight_at_start: int
    left_after_grace: int


def health_policy(spec: ModelSpec) -> HealthPolicy:
    return HealthPolicy(
        canary_interval_s=spec.canary_interval_s,
        canary_timeout_s=spec.canary_timeout_s,
        failure_threshold=spec.failure_threshold,
    )


def worker_client(address: str, spec: ModelSpec) -> WorkerClient:
    tls = spec.worker_tls
    stream = spec.worker_stream
    if tls is None:
        return WorkerClient(address, health_policy(spec), worker_stream=stream)
    creds = channel_credentials(tls.ca, tls.cert, tls.key, what="worker_tls")
    return WorkerClient(address, health_policy(spec), creds, tls.server_name, worker_stream=stream)


async def resolve(hostport: str) -> list[str]:
    """Every address behind a name, as host:port, sorted (a headless Service's pods)."""
    host, _, port = hostport.rpartition(":")
    infos = await asyncio.get_running_loop().getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    out = set()
    for family, *_, sockaddr in infos:
        ip = str(sockaddr[0])
        out.add(f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}")
    return sorted(out)


WORKER_SERVICE_NAME = "switchyard-vllm-worker"


def visible_devices(model: str, gpus: Sequence[str], parent: str | None) -> str:
    """A worker's CUDA_VISIBLE_DEVICES: `gpus`, whose indices count the GPUs this process
    sees (its own CUDA_VISIBLE_DEVICES, a scheduler's allocation, when set); UUIDs pass."""
    seen = [g.strip() for g in (parent or "").split(",") if g.strip()]
    if not seen:
        return ",".join(gpus)
    out = []
    for g in gpus:
        if not g.isdigit():
            out.append(g)
        elif int(g) < len(seen):
            out.append(seen[int(g)])
        else:
            raise StartupError(
                f"model {model!r}: gpus: GPU {g} is not among the {len(seen)} this control "
                f"plane sees (CUDA_VISIBLE_DEVICES={parent})"
            )
    return ",".join(out)


class ModelLoader:
    """Starts, joins, drains and stops the workers of models in a registry."""

    def _worker_env(self, spec: ModelSpec, replica: int = 0) -> dict[str, str] | None:
        """This process's environment (NCCL's settings among it), with the replica's share
        of the model's `gpus` as CUDA_VISIBLE_DEVICES, and for a traced vLLM worker the
        service its spans name (OpenTelemetry's OTEL_SERVICE_NAME). None: unchanged."""
        gpus = spec.replica_gpus(replica)
        traced = self.otlp_endpoint is not None and spec.engine == "vllm"
        if not gpus and not traced:
            return None
        env = dict(os.environ)
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = visible_devices(
                spec.name, gpus, os.environ.get("CUDA_VISIBLE_DEVICES")
            )
        if traced:
            env["OTEL_SERVICE_NAME"] = WORKER_SERVICE_NAME
            if not str(self.otlp_endpoint).startswith("https://"):  # plaintext, as the endpoint's
                env.setdefault("OTEL_EXPORTER_OTLP_TRACES_INSECURE", "true")
        return env

    def __init__(
        self, registry: ModelRegistry, listen_host: str, otlp_endpoint: str | None = None
    ) -> None:
        self.registry = registry
        # Where the vLLM workers it starts export their engine's spans (unless the
        # model's engine_args name one): the control plane's own trace endpoint.
        self.otlp_endpoint = otlp_endpoint
        host = listen_host or "127.0.0.1"
        self.worker_host = "127.0.0.1" if host in ("0.0.0.0", "[::]", "::") else host
        self.loading = registry.loading
        self._discovery: dict[str, asyncio.Task[None]] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._joining: set[str] = set()

    async def load(self, spec: ModelSpec) -> ModelEntry:
        if self.registry.find(spec.name) is not None:
            raise StartupError(f"model {spec.name!r} is already loaded")
        self.loading.add(spec.name)
        started = time.monotonic()
        local: list[LocalWorker] = []
        clients: list[WorkerClient] = []
        try:
            model_path = spec.model
            if spec.is_builtin:
                model_path = str(await asyncio.to_thread(ensure_tiny_model))
            tokenizer = await asyncio.to_thread(Tokenizer, spec.tokenizer or model_path)
            addresses = list(spec.workers)
            if spec.dns:
                addresses += [a for a in await resolve(spec.dns) if a not in addresses]
            elif not addresses:
                for i in range(spec.replicas):
                    port = free_port(self.worker_host)
                    name = f"{spec.name}-{i}"
                    term = termination_log_path(name, port)
                    cmd = worker_command(
                        spec, model_path, port, tokenizer, term, self.otlp_endpoint
                    )
                    lw = LocalWorker(
                        name,
                        cmd,
                        f"{self.worker_host}:{port}",
                        termination_log=term,
                        env=self._worker_env(spec, i),
                    )
                    await lw.start()
                    local.append(lw)
                    addresses.append(lw.address)
            clients = [worker_client(a, spec) for a in addresses]
            placed = {"gpus": [",".join(lw.gpus) for lw in local]} if spec.gpus else {}
            log.info(
                "loading model", model=spec.name, engine=spec.engine, workers=addresses, **placed
            )
            if spec.dns:
                # Behind a name, some addresses may never answer (a pod going away, an
                # IPv6 record nobody listens on): load with those that serve.
                ready_s = max(10.0, spec.dns_interval_s * 3)
                got = await asyncio.gather(
                    *(c.wait_ready(ready_s) for c in clients), return_exceptions=True
                )
                for c, g in zip(clients, got, strict=True):
                    if isinstance(g, BaseException):
                        log.warning("discovered worker not serving", worker=c.address)
                        await c.close()
                infos = [g for g in got if isinstance(g, WorkerInfo)]
                clients = [
                    c for c, g in zip(clients, got, strict=True) if isinstance(g, WorkerInfo)
                ]
            else:
                async with asyncio.TaskGroup() as tg:  # one failure cancels the others
                    waits = [
                        tg.create_task(self._wait_worker(spec.name, c, local)) for c in clients
                    ]
                infos = [w.result() for w in waits]
            info = self._agree(spec, infos)
            if tokenizer.vocab_size > info.vocab_size:
                raise StartupError(
                    f"model {spec.name}: the tokenizer has {tokenizer.vocab_size} tokens but "
                    f"the model only {info.vocab_size}"
                )
            entry = ModelEntry(
                spec=spec,
                tokenizer=tokenizer,
                info=info,
                workers=clients,
                limit_state=self.registry.limit_state,
            )
            entry.local = local
            # Still loading (and cleaned up if cancelled) while its index fills.
            await self._sync_kv(entry, clients)
        except BaseException as e:
            await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)
            await asyncio.gather(*(w.stop() for w in local), return_exceptions=True)
            cause = root_cause(e)
            if isinstance(cause, StartupError):
                raise cause from e
            if isinstance(cause, Exception):
                raise StartupError(f"model {spec.name}: {type(cause).__name__}: {cause}") from e
            raise
        finally:
            self.loading.discard(spec.name)
        self.registry.add(entry)
        if spec.dns:
            self._discovery[spec.name] = asyncio.create_task(
                self._follow_dns(entry), name=f"dns {spec.dns}"
            )
        log.info(
            "model ready",
            model=spec.name,
            engine=info.label,
            workers=len(clients),
            seconds=round(time.monotonic() - started, 2),
        )
        return entry

    @staticmethod
    async def _sync_kv(entry: ModelEntry, clients: list[WorkerClient]) -> None:
        """Until the model's index has what each worker's engine holds (bounded), where
        its routing follows KV-cache events."""
        if entry.kv_index is None or not any(c.info and c.info.kv_events for c in clients):
            return
        started = time.monotonic()
        missing = await health.wait_kv_synced(clients, KV_SYNC_TIMEOUT_S)
        if missing:
            log.warning(
                "routing starts before these workers' KV-cache events arrived",
                model=entry.name,
                workers=missing,
                waited_s=KV_SYNC_TIMEOUT_S,
            )
        else:
            log.info(
                "kv index synced",
                model=entry.name,
                workers=len(clients),
                seconds=round(time.monotonic() - started, 3),
            )

    @staticmethod
    def _agree(spec: ModelSpec, infos: list[WorkerInfo]) -> WorkerInfo:
        if not infos:
            raise StartupError(f"model {spec.name}: no worker address (replicas, workers, dns)")
        first = infos[0]
        for other in infos[1:]:
            if (other.max_context, other.vocab_size) != (first.max_context, first.vocab_size):
                raise StartupError(f"model {spec.name}: workers disagree on context or vocabulary")
        return first

    async def _wait_worker(
        self, spec_name: str, client: WorkerClient, local: list[LocalWorker]
    ) -> WorkerInfo:
        proc = next((lw for lw in local if lw.address == client.address), None)
        if proc is None or proc.proc is None:
            # A remote worker is expected up already; an engine we start may take minutes.
            return await client.wait_ready(REMOTE_READY_TIMEOUT_S)
        ready = asyncio.create_task(client.wait_ready(WORKER_READY_TIMEOUT_S))
        died = asyncio.create_task(proc.proc.wait())
        try:
            done, _ = await asyncio.wait({ready, died}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (ready, died):
                if not t.done():
                    t.cancel()
        if ready in done:
            return ready.result()
        said = proc.termination_message()
        if said is not None:
            raise StartupError(f"model {spec_name}: {said}")
        raise StartupError(
            f"worker {proc.name} exited with code {proc.exited} before it was ready "
            "(its log is above)"
        )

    async def unload(self, name: str, grace_s: float) -> DrainResult:
        """Stop routing to the model, let in-flight requests finish (up to grace_s), then
        stop its workers. New requests for it get NOT_FOUND from the start."""
        entry = self.registry.find(name)
        if entry is None:
            raise KeyError(name)
        entry.accepting = False
        task = self._discovery.pop(name, None)
        if task is not None:
            task.cancel()
        # Stop routing to its workers at once (their channels close after the grace).
        adm = entry.admission
        at_start = adm.running + adm.queued
        deadline = time.monotonic() + grace_s
        # Polled: requests end on many paths, and 20 ms is plenty for an unload.
        while adm.running + adm.queued > 0 and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.02)
        left = adm.running + adm.queued
        self.registry.remove(name)
        await self.stop_entry(entry)
        log.info("model unloaded", model=name, drained=at_start, cancelled=left)
        return DrainResult(at_start, left)

    async def drain_worker(self, worker: WorkerClient, grace_s: float) -> DrainResult:
        worker.draining = True
        at_start = worker.in_flight
        deadline = time.monotonic() + grace_s
        while worker.in_flight > 0 and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.02)
        log.info("worker drained", worker=worker.address, left=worker.in_flight)
        return DrainResult(at_start, worker.in_flight)

    async def stop_entry(self, entry: ModelEntry) -> None:
        # Channels first: their health and load streams would hold a draining worker open.
        await asyncio.gather(*(c.close() for c in entry.workers), return_exceptions=True)
        await asyncio.gather(*(w.stop() for w in entry.local), return_exceptions=True)

    async def stop_all(self) -> None:
        tasks = [*self._discovery.values(), *self._background]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(
            *(self.stop_entry(e) for e in self.registry.all()), return_exceptions=True
        )

    async def _follow_dns(self, entry: ModelEntry) -> None:
        """Re-resolve the model's DNS name: new addresses join once they serve; vanished
        ones stop taking requests and leave when their in-flight requests are done."""
        spec = entry.spec
        assert spec.dns is not None
        while True:
            await asyncio.sleep(spec.dns_interval_s)
            try:
                current = set(await resolve(spec.dns))
            except OSError as e:
                log.warning("dns lookup failed", name=spec.dns, error=str(e))
                continue
            known = {w.address for w in entry.workers}
            for address in sorted(current - known - self._joining):
                self._spawn(self._join(entry, address), f"join {address}")
            for w in [w for w in entry.workers if w.address not in current and not w.leaving]:
                self._spawn(self._leave(entry, w), f"leave {w.address}")

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _join(self, entry: ModelEntry, address: str) -> None:
        self._joining.add(address)
        client = worker_client(address, entry.spec)
        joined = False

        def still_wanted() -> bool:
            return self.registry.find(entry.name) is entry and entry.accepting

        try:
            await client.wait_ready(max(10.0, entry.spec.dns_interval_s * 3))
            if still_wanted():
                client.kv_sink = entry.kv_index
                await self._sync_kv(entry, [client])
            if still_wanted():  # the model may have gone away meanwhile
                entry.workers.append(client)
                joined = True
                log.info("worker joined", model=entry.name, worker=address)
        except Exception as e:
            log.warning("discovered worker never served", worker=address, error=str(e))
        finally:
            self._joining.discard(address)
            if not joined:  # also when cancelled
                await client.close()

    async def _leave(self, entry: ModelEntry, worker: WorkerClient) -> None:
        worker.leaving = True
        await self.drain_worker(worker, grace_s=60.0)
        if worker in entry.workers:
            entry.workers.remove(worker)
        await worker.close()
        log.info("worker left", model=entry.name, worker=worker.address)
