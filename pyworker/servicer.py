"""The `switchyard.worker.v1.Worker` servicer: thin RPC adapters over `Generations`.

`Generate` sends one request's messages on its own call; `GenerateStream` hands every
request of a stream to a `Session`; `Abort`, `GetInfo` and `StreamLoad` answer from the
engine's state. Every stream that was accepted ends with exactly one Final, or with a
status if it failed before its first token.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import Any

import grpc
import structlog
from switchyard.v1 import common_pb2
from switchyard.worker.v1 import worker_pb2

from pyworker.adapters import Adapter
from pyworker.engine import Engine
from pyworker.errors import StatusError, abort_with
from pyworker.generations import Generations, StreamClosed
from pyworker.kv_events import KvEvents
from pyworker.request import deadline_after
from pyworker.session import Session

log = structlog.get_logger(__name__)

Context = grpc.aio.ServicerContext[Any, Any]

DEFAULT_LOAD_INTERVAL_MS = 500
MIN_LOAD_INTERVAL_MS = 10
_NO_DEADLINE_S = 1e7  # time_remaining() beyond this means "no deadline"


class WorkerServicer:
    """Implements Generate, GenerateStream, Abort, GetInfo, StreamLoad, LoadAdapter and
    UnloadAdapter for one engine."""

    def __init__(self, engine: Engine, *, rate_window_s: float = 2.0) -> None:
        self._engine = engine
        self.generations = Generations(engine, rate_window_s=rate_window_s)
        endpoint = engine.kv_events_endpoint
        self.kv_events = KvEvents(endpoint) if endpoint else None

    @property
    def in_flight(self) -> int:
        return self.generations.in_flight

    async def Generate(self, request: Any, context: Context) -> None:
        arrived = time.monotonic()
        try:
            state, parsed = self.generations.admit(request, request.request_id or uuid.uuid4().hex)
        except StatusError as exc:
            await abort_with(context, exc)
        remaining = context.time_remaining()
        deadline: float | None = None
        if remaining is not None and remaining <= _NO_DEADLINE_S:
            deadline = deadline_after(remaining)
        await self.generations.serve(parsed, state, CallSink(context), arrived, deadline)

    async def GenerateStream(self, request_iterator: Any, context: Context) -> None:
        await Session(self.generations, context.write).run(request_iterator)

    async def Abort(self, request: Any, context: Context) -> Any:
        try:
            aborted = await self.generations.abort(request.request_ids)
        except StatusError as exc:
            await abort_with(context, exc)
        return worker_pb2.AbortResponse(aborted=aborted)

    async def GetInfo(self, request: Any, context: Context) -> Any:
        info = self._engine.info
        gpu = self._engine.gpu.read()
        return worker_pb2.GetInfoResponse(
            engine=info.engine,
            engine_version=info.engine_version,
            model=info.model,
            max_context=info.max_context,
            vocab_size=info.vocab_size,
            eos_token_ids=list(info.eos_token_ids),
            kv_block_size=info.kv_block_size,
            generate_stream=True,
            tensor_parallel_size=info.tensor_parallel_size,
            pipeline_parallel_size=info.pipeline_parallel_size,
            quantization=info.quantization,
            weight_dtype=info.weight_dtype,
            kv_cache_dtype=info.kv_cache_dtype,
            kv_blocks_total=info.kv_blocks_total,
            max_input_len=info.max_context,
            max_batch_size=info.max_batch_size,
            max_num_tokens=info.max_num_tokens,
            gpu_memory_used_bytes=gpu.used_bytes,
            gpu_memory_total_bytes=gpu.total_bytes,
            # What this worker passes on to vLLM today; more as the API grows.
            capabilities=common_pb2.Capabilities(
                max_logprobs=info.max_logprobs,
                max_n=1,
                prompt_logprobs=True,
                structured_output=info.structured_output,
                lora=info.lora.enabled,
                max_loras=info.lora.max_loras,
                max_lora_rank=info.lora.max_lora_rank,
                beam_search=info.max_beam_width > 0,
                max_beam_width=info.max_beam_width,
                resume_tokens=True,
                stream_interval=True,
                resumable_constraints=info.resumable_constraints,
            ),
            adapters=[_adapter_info(a) for a in self.generations.adapters.all()],
            kv_events=self.kv_events is not None,
        )

    async def SubscribeKvEvents(self, request: Any, context: Context) -> Any:
        if self.kv_events is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "this worker's engine publishes no KV-cache events (prefix caching is off, "
                "or engine_args set kv_events_config)",
            )
            return
        self.kv_events.start_once()
        async with contextlib.aclosing(self.kv_events.subscribe()) as batches:
            async for batch in batches:
                await context.write(batch)

    async def LoadAdapter(self, request: Any, context: Context) -> Any:
        try:
            adapter = await self.generations.load_adapter(request.name, request.path)
        except StatusError as exc:
            log.info("load adapter refused", adapter=request.name, error=exc.message)
            await abort_with(context, exc)
        return worker_pb2.LoadAdapterResponse(adapter=_adapter_info(adapter))

    async def UnloadAdapter(self, request: Any, context: Context) -> Any:
        try:
            drained, cancelled = await self.generations.unload_adapter(
                request.name, request.grace_ms / 1000.0
            )
        except StatusError as exc:
            await abort_with(context, exc)
        return worker_pb2.UnloadAdapterResponse(
            waited_requests=drained, cancelled_requests=cancelled
        )

    async def StreamLoad(self, request: Any, context: Context) -> None:
        interval_ms = int(request.interval_ms) or DEFAULT_LOAD_INTERVAL_MS
        interval_s = max(interval_ms, MIN_LOAD_INTERVAL_MS) / 1000.0
        next_at = time.monotonic()
        while True:
            await context.write(self.generations.load_report())
            next_at += interval_s
            delay = next_at - time.monotonic()
            if delay < 0:  # fell behind: skip the missed reports rather than burst
                next_at = time.monotonic()
                delay = 0.0
            await asyncio.sleep(delay)

    def load_report(self) -> Any:
        return self.generations.load_report()


def _adapter_info(adapter: Adapter) -> Any:
    return worker_pb2.AdapterInfo(
        name=adapter.name, path=adapter.path, rank=adapter.rank, in_flight=len(adapter.in_flight)
    )


class CallSink:
    """Generate: each message is one write on the request's own call."""

    blocking = True

    def __init__(self, context: Context) -> None:
        self._context = context

    async def chunk(self, chunk: Any) -> None:
        await _write(self._context, worker_pb2.GenerateResponse(chunk=chunk))

    async def final(self, final: Any) -> None:
        await _write(self._context, worker_pb2.GenerateResponse(final=final))

    async def time_limit(self, final: Any) -> None:
        try:
            await self.final(final)
        except StreamClosed:
            # Never a silent OK without a final.
            await self._context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline expired")

    async def error(self, exc: StatusError) -> None:
        await abort_with(self._context, exc)


async def _write(context: Context, message: Any) -> None:
    try:
        await context.write(message)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        raise StreamClosed(str(exc)) from exc
