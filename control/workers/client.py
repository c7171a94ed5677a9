"""One connection to one worker (`switchyard.worker.v1.Worker`), whatever its engine.

It knows the worker's identity (`GetInfo`), follows its health (`grpc.health.v1`
Watch) and load (`StreamLoad`), and counts the requests the control plane has in
flight on it.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from switchyard.v1 import common_pb2
from switchyard.worker.v1 import worker_pb2, worker_pb2_grpc

from control.errors import (
    AlreadyExists,
    FailedPrecondition,
    FieldViolation,
    InvalidArgument,
    NotFound,
    Overloaded,
    SwitchyardError,
    WorkerFailed,
)
from control.workers import health
from control.workers.call import WorkerCall
from control.workers.circuit import CircuitBreaker
from control.workers.health import Load
from control.workers.stream import StreamSession
from switchyard_common.rpc_status import read_details

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


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a worker's engine can do through the API (switchyard.v1.Capabilities)."""

    max_logprobs: int = 0
    prompt_logprobs: bool = False
    structured_output: frozenset[str] = frozenset()
    max_n: int = 1
    beam_search: bool = False
    lora: bool = False
    max_loras: int = 0
    max_lora_rank: int = 0
    max_beam_width: int = 0
    resume_tokens: bool = False  # takes resume_token_ids apart from the prompt
    resumable_constraints: frozenset[str] = frozenset()  # kinds it continues mid-output

    @classmethod
    def of(cls, msg: Any) -> Capabilities:
        return cls(
            max_logprobs=msg.max_logprobs,
            prompt_logprobs=msg.prompt_logprobs,
            structured_output=frozenset(msg.structured_output),
            max_n=max(1, msg.max_n),
            beam_search=msg.beam_search,
            lora=msg.lora,
            max_loras=msg.max_loras,
            max_lora_rank=msg.max_lora_rank,
            max_beam_width=msg.max_beam_width if msg.beam_search else 0,
            resume_tokens=msg.resume_tokens,
            resumable_constraints=frozenset(msg.resumable_constraints),
        )

    def to_proto(self) -> common_pb2.Capabilities:
        return common_pb2.Capabilities(
            max_logprobs=self.max_logprobs,
            prompt_logprobs=self.prompt_logprobs,
            structured_output=sorted(self.structured_output),
            max_n=self.max_n,
            beam_search=self.beam_search,
            lora=self.lora,
            max_loras=self.max_loras,
            max_lora_rank=self.max_lora_rank,
            max_beam_width=self.max_beam_width,
            resume_tokens=self.resume_tokens,
            resumable_constraints=sorted(self.resumable_constraints),
        )


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    engine: str
    engine_version: str
    model: str
    max_context: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    kv_block_size: int
    generate_stream: bool = False
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    quantization: str = ""
    weight_dtype: str = ""
    kv_cache_dtype: str = ""
    kv_blocks_total: int = 0
    gpu_memory_total_bytes: int = 0
    capabilities: Capabilities | None = None  # None: a worker that does not declare them
    kv_events: bool = False  # serves SubscribeKvEvents

    @property
    def label(self) -> str:
        return f"{self.engine} {self.engine_version}"


class WorkerNotReady(RuntimeError):
    pass


class KvSink(Protocol):
    """Where a worker's KV-cache events go (control.routing.kv_index.KvIndex): by the
    worker's address, and the engine's own block hashes."""

    def stored(
        self,
        worker: str,
        engine_hashes: Sequence[int],
        parent_engine_hash: int | None,
        token_ids: Sequence[int],
        block_size: int,
        salt: str = "",
    ) -> bool: ...

    def removed(self, worker: str, engine_hashes: Iterable[int]) -> None: ...

    def cleared(self, worker: str) -> None: ...


@dataclass(frozen=True, slots=True)
class HealthPolicy:
    canary_interval_s: float = 5.0
    canary_timeout_s: float = 2.0
    failure_threshold: int = 3
    worker_stream: bool = True  # use GenerateStream when the worker offers it


class WorkerClient:
    """A worker as the control plane sees it; also a routing `Candidate`."""

    def __init__(
        self,
        address: str,
        health: HealthPolicy | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        server_name: str | None = None,
    ) -> None:
        self.address = address
        self.health_policy = health or HealthPolicy()
        if credentials is None:
            self.channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        else:  # TLS (models[].worker_tls)
            options: list[tuple[str, int | str]] = list(CHANNEL_OPTIONS)
            if server_name:
                options.append(("grpc.ssl_target_name_override", server_name))
            self.channel = grpc.aio.secure_channel(address, credentials, options=options)
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)
        self.info: WorkerInfo | None = None
        self._kv_sink: KvSink | None = None
        self.kv_sink_set = asyncio.Event()  # its model has given it a sink
        # The current KV-events subscription's snapshot (what the engine holds) is in the
        # sink, to the batch that ends it; cleared when the stream ends.
        self.kv_synced = asyncio.Event()
        self.serving = False
        self.draining = False
        self.leaving = False  # gone from DNS; removed once drained
        self.in_flight = 0
        self.in_flight_tokens = 0
        self.in_flight_at_report = 0  # in_flight when `load` was reported
        self.prefill_tokens = 0  # prompt tokens of the calls with no message back yet
        self.adapters: set[str] = set()  # the LoRA adapters it holds, as far as we know
        self.load = Load()
        self.breaker = CircuitBreaker(failure_threshold=self.health_policy.failure_threshold)
        self.last_canary_ms: float | None = None
        self.calls: set[WorkerCall] = set()  # generations in flight on this worker
        self._attempts = itertools.count(1)
        self._tasks: list[asyncio.Task[None]] = []
        self._stream: StreamSession | None = None

    @property
    def kv_sink(self) -> KvSink | None:
        """Where its KV-cache events go: its model's index, set by the model where routing
        reads the events (None: nowhere, and they are not followed)."""
        return self._kv_sink

    @kv_sink.setter
    def kv_sink(self, sink: KvSink | None) -> None:
        self._kv_sink = sink
        if sink is None:
            self.kv_sink_set.clear()
        else:
            self.kv_sink_set.set()

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
        if self.health_policy.worker_stream and self.info and self.info.generate_stream:
            if self._stream is None:
                self._stream = StreamSession(
                    self.stub, self.address, on_break=self.breaker.record_failure
                )
            stream = self._stream
            return WorkerCall(
                self,
                lambda: stream.open(request, timeout),
                cost_tokens,
                request.adapter,
                prompt_tokens,
            )
        # Generate keys requests by request_id on the worker: make each attempt's unique.
        request.request_id = f"{request.request_id}~{next(self._attempts)}"
        return WorkerCall(
            self,
            lambda: self.stub.Generate(request, timeout=timeout),
            cost_tokens,
            request.adapter,
            prompt_tokens,
        )

    @property
    def healthy(self) -> bool:
        """Eligible for new requests: SERVING, known, circuit closed, not draining."""
        return (
            self.serving
            and self.info is not None
            and not self.draining
            and self.breaker.allows_traffic()
        )

    @property
    def running(self) -> int:
        return self.load.running

    @property
    def waiting(self) -> int:
        return self.load.waiting

    def state(self, peek: bool = False) -> str:
        """closed, open, half_open, draining or not_serving; `peek` reads it without
        changing the breaker (for the metrics thread)."""
        if self.draining:
            return "draining"
        if not self.serving:
            return "not_serving"
        return (self.breaker.peek() if peek else self.breaker.state).value

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
        """Load a LoRA adapter on this worker; its rank. Raises a SwitchyardError."""
        req = worker_pb2.LoadAdapterRequest(name=name, path=path)
        try:
            r = await self.stub.LoadAdapter(req, timeout=timeout)
        except grpc.aio.AioRpcError as e:
            raise admin_error(self.address, e) from e
        return int(r.adapter.rank)

    async def unload_adapter(self, name: str, grace_s: float) -> tuple[int, int]:
        """Unload it once its requests are done (up to `grace_s`, then they are
        cancelled): (drained, cancelled). Raises a SwitchyardError."""
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
            self._tasks = [
                asyncio.create_task(health.watch_health(self), name=f"health {self.address}"),
                asyncio.create_task(health.watch_load(self), name=f"load {self.address}"),
                asyncio.create_task(health.canary(self), name=f"canary {self.address}"),
                asyncio.create_task(health.watch_kv_events(self), name=f"kv {self.address}"),
            ]

    async def probe(self, timeout: float) -> bool:
        return await health.probe(self, timeout) == "ok"

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
        await self.channel.close(grace=None)


def admin_error(address: str, e: grpc.aio.AioRpcError) -> SwitchyardError:
    """A worker's answer to an adapter call, as the control plane's error: the caller
    hears the worker's code, its field violations and its words, with its address."""
    code = e.code()
    message = f"worker {address}: {e.details() or code.name}"
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        said = read_details(e.trailing_metadata()).violations
        return InvalidArgument(list(said) or [FieldViolation("path", message)])
    if code == grpc.StatusCode.NOT_FOUND:
        return NotFound(message)
    if code == grpc.StatusCode.ALREADY_EXISTS:
        return AlreadyExists(message)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return Overloaded(message, retry_after_s=0.0)
    if code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED):
        return FailedPrecondition(f"{message} (this worker has no LoRA)", field="adapter")
    return WorkerFailed(address, e.details() or code.name)
