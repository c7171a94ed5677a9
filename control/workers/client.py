"""One connection to one worker (`switchyard.worker.v1.Worker`), whatever its engine.

A `WorkerClient` is the worker's state (control.workers.state) with a channel: it reads
the worker's identity (`GetInfo`), runs the tasks that follow its health, load and
KV-cache events (control.workers.health), starts generations on its transport
(control.workers.call) and calls its adapter RPCs.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from switchyard.worker.v1 import worker_pb2, worker_pb2_grpc

from control.workers import health
from control.workers.call import Transport, UnaryTransport, WorkerCall, admin_error
from control.workers.health import HealthPolicy
from control.workers.state import Capabilities, WorkerInfo, WorkerState
from control.workers.stream import StreamSession

log = structlog.get_logger(__name__)

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    # Workers come and go (start-up, restarts): reconnect quickly, not after gRPC's default
    # backoff of up to two minutes.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
    # A bounded receive window: when the control plane falls behind, the worker's writes
    # wait and it merges the tokens that pile up into fewer, larger messages, instead of
    # the transport buffering megabytes of one-token messages that every request on the
    # shared GenerateStream (new ones too) must wait behind.
    ("grpc.http2.bdp_probe", 0),
    ("grpc.http2.lookahead_bytes", 16 * 1024),
]


class WorkerNotReady(RuntimeError):
    pass


class WorkerClient(WorkerState):
    """A worker as the control plane sees it, with its channel; also a routing
    `Candidate`. `worker_stream`: its generations share one GenerateStream when it offers
    one. `transport`: how they travel instead (a test's fake)."""

    def __init__(
        self,
        address: str,
        health: HealthPolicy | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        server_name: str | None = None,
        *,
        worker_stream: bool = True,
        transport: Transport | None = None,
    ) -> None:
        self.health_policy = health or HealthPolicy()
        super().__init__(address, self.health_policy.failure_threshold)
        if credentials is None:
            self.channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        else:  # TLS (models[].worker_tls)
            options: list[tuple[str, int | str]] = list(CHANNEL_OPTIONS)
            if server_name:
                options.append(("grpc.ssl_target_name_override", server_name))
            self.channel = grpc.aio.secure_channel(address, credentials, options=options)
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)
        self.worker_stream = worker_stream
        self._transport = transport
        self._unary = UnaryTransport(self.stub)
        self._stream: StreamSession | None = None
        self._tasks: list[asyncio.Task[None]] = []

    def generate(
        self,
        request: worker_pb2.GenerateRequest,
        timeout: float | None,
        cost_tokens: int = 0,
        prompt_tokens: int = 0,
    ) -> WorkerCall:
        """One generation, as `async with worker.generate(...) as events`: on the worker's
        shared GenerateStream when it has one, else as its own Generate call. The call
        counts itself in flight (`cost_tokens` of prompt plus output) while it runs, and
        its `prompt_tokens` as prefill until its first message; it raises
        `WorkerCallFailed` for every way it can fail."""
        return WorkerCall(self, self._transport_now(), request, timeout, cost_tokens, prompt_tokens)

    def _transport_now(self) -> Transport:
        if self._transport is not None:
            return self._transport
        if self.worker_stream and self.info and self.info.generate_stream:
            if self._stream is None:
                self._stream = StreamSession(
                    self.stub,
                    self.address,
                    on_break=self.breaker.record_failure,
                    raw_stream=self._raw_generate_stream,
                )
            return self._stream
        return self._unary

    def _raw_generate_stream(self) -> Any:
        """GenerateStream with the worker's messages as bytes (StreamSession parses them:
        the native front's direct path reads them first)."""
        method = self.channel.stream_stream(
            "/switchyard.worker.v1.Worker/GenerateStream",
            request_serializer=worker_pb2.StreamRequest.SerializeToString,
            response_deserializer=None,
        )
        return method()  # type: ignore[call-arg]  # grpc.aio: requests are written

    async def check_serving(self, timeout: float = 2.0) -> bool:
        try:
            resp = await self.health_stub.Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout
            )
        except grpc.aio.AioRpcError:
            return False
        return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)

    async def fetch_info(self, timeout: float = 10.0) -> WorkerInfo:
        r = await self.stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=timeout)
        self.info = WorkerInfo(
            engine=r.engine,
            engine_version=r.engine_version,
            model=r.model,
            max_context=r.max_context,
            vocab_size=r.vocab_size,
            eos_token_ids=tuple(r.eos_token_ids),
            kv_block_size=r.kv_block_size,
            generate_stream=r.generate_stream,
            tensor_parallel_size=r.tensor_parallel_size or 1,
            pipeline_parallel_size=r.pipeline_parallel_size or 1,
            quantization=r.quantization,
            weight_dtype=r.weight_dtype,
            kv_cache_dtype=r.kv_cache_dtype,
            kv_blocks_total=r.kv_blocks_total,
            gpu_memory_total_bytes=r.gpu_memory_total_bytes,
            capabilities=Capabilities.of(r.capabilities) if r.HasField("capabilities") else None,
            kv_events=r.kv_events,
        )
        return self.info

    async def load_adapter(self, name: str, path: str, timeout: float = 300.0) -> int:
        """Load a LoRA adapter on this worker; its rank. Raises a StatusError."""
        req = worker_pb2.LoadAdapterRequest(name=name, path=path)
        try:
            r = await self.stub.LoadAdapter(req, timeout=timeout)
        except grpc.aio.AioRpcError as e:
            raise admin_error(self.address, e) from e
        return int(r.adapter.rank)

    async def unload_adapter(self, name: str, grace_s: float) -> tuple[int, int]:
        """Unload it once its requests are done (up to `grace_s`, then they are
        cancelled): (drained, cancelled). Raises a StatusError."""
        req = worker_pb2.UnloadAdapterRequest(name=name, grace_ms=round(grace_s * 1000))
        try:
            r = await self.stub.UnloadAdapter(req, timeout=grace_s + 60.0)
        except grpc.aio.AioRpcError as e:
            raise admin_error(self.address, e) from e
        return int(r.waited_requests), int(r.cancelled_requests)

    async def wait_ready(self, timeout: float, poll: float = 0.5) -> WorkerInfo:
        """Poll health until SERVING, then read GetInfo; start following health and load."""
        deadline = time.monotonic() + timeout
        last_note = time.monotonic()
        while not await self.check_serving():
            now = time.monotonic()
            if now > deadline:
                raise WorkerNotReady(f"worker {self.address} not SERVING after {timeout:.0f} s")
            if now - last_note > 10:
                log.info("waiting for worker", worker=self.address, remaining_s=int(deadline - now))
                last_note = now
            await asyncio.sleep(poll)
        info = await self.fetch_info()
        self.serving = True
        self.start_watching()
        return info

    def start_watching(self) -> None:
        if not self._tasks:
            tasks = {
                "health": health.watch_health(self, self.health_stub),
                "load": health.watch_load(self, self.stub),
                "canary": health.canary(self, self.stub, self.health_policy),
                "kv": health.watch_kv_events(self, self.stub),
            }
            self._tasks = [
                asyncio.create_task(task, name=f"{what} {self.address}")
                for what, task in tasks.items()
            ]

    async def probe(self, timeout: float) -> bool:
        return await health.probe(self, self.stub, timeout) == "ok"

    async def close(self) -> None:
        self.serving = False
        self.draining = True
        tasks, self._tasks = self._tasks, []
        for t in tasks:
            t.cancel()
        # Waiting for them to end; a cancellation of our own caller still propagates.
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._stream is not None:
            await self._stream.close()
        if self._transport is not None:
            await self._transport.close()
        await self.channel.close(grace=None)
