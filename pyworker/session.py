"""`GenerateStream`: many requests over one stream, one message per engine step.

vLLM hands the outputs of one engine step to every request's `generate()` in one pass
of the event loop. Each request's task drops its news into the session's pending message
(a request's consecutive chunks merge into one event); the writer task runs after them
and sends everything as one `StreamResponse`. While a write is in flight the next
message fills up, so a slow reader gets fewer, larger messages and never blocks the
engine. Closing the stream (or losing the client) cancels every request on it, which
aborts them in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING, Any

import structlog
from switchyard.worker.v1 import worker_pb2

from pyworker.errors import AlreadyExists, InvalidArgument, WorkerError
from pyworker.request import deadline_after

if TYPE_CHECKING:
    from pyworker.servicer import Context, WorkerServicer

log = structlog.get_logger(__name__)


class Session:
    """One GenerateStream call."""

    def __init__(self, servicer: WorkerServicer, context: Context) -> None:
        self._servicer = servicer
        self._context = context
        self._pending = worker_pb2.StreamResponse()
        self._open_chunks: dict[str, Any] = {}  # request id -> its chunk in _pending
        self._ready = asyncio.Event()
        self._closing = False
        self._tasks: dict[str, asyncio.Task[None]] = {}

    async def run(self, request_iterator: Any) -> None:
        writer = asyncio.create_task(self._write_loop(), name="generate-stream writer")
        try:
            async for message in request_iterator:
                for request in message.start:
                    self._start(request)
                for request_id in message.cancel:
                    task = self._tasks.get(request_id)
                    if task is not None:
                        task.cancel()
            # The caller closed its side: finish what runs, send the rest, then end.
            while self._tasks:
                await asyncio.gather(*self._tasks.values(), return_exceptions=True)
            self._closing = True
            self._ready.set()
            await writer
        finally:
            for task in self._tasks.values():
                task.cancel()
            writer.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await writer

    def _start(self, request: Any) -> None:
        arrived = time.monotonic()
        request_id = request.request_id
        try:
            if not request_id:
                raise InvalidArgument.field("request_id", "required on GenerateStream")
            if request_id in self._tasks:
                raise AlreadyExists(f"request_id {request_id!r} is already on this stream")
            state, parsed = self._servicer.admit(request)
        except WorkerError as exc:
            self._error(request_id, exc)
            return
        deadline = deadline_after(request.timeout_ms / 1000.0) if request.timeout_ms else None
        sink = _EventSink(self, request_id)
        task = asyncio.create_task(
            self._servicer.serve(parsed, state, sink, arrived, deadline), name=request_id
        )
        self._tasks[request_id] = task
        task.add_done_callback(lambda _t: self._tasks.pop(request_id, None))

    # ---- the pending message ---------------------------------------------------------

    def _chunk(self, request_id: str, chunk: Any) -> None:
        open_chunk = self._open_chunks.get(request_id)
        if open_chunk is not None:
            open_chunk.MergeFrom(chunk)  # repeated fields append
        else:
            event = self._pending.events.add(request_id=request_id, chunk=chunk)
            self._open_chunks[request_id] = event.chunk
        self._ready.set()

    def _final(self, request_id: str, final: Any) -> None:
        self._pending.events.add(request_id=request_id, final=final)
        self._open_chunks.pop(request_id, None)
        self._ready.set()

    def _error(self, request_id: str, exc: WorkerError) -> None:
        error = worker_pb2.StreamError(code=exc.code.value[0], message=exc.message)
        self._pending.events.add(request_id=request_id, error=error)
        self._open_chunks.pop(request_id, None)
        self._ready.set()

    async def _write_loop(self) -> None:
        while True:
            await self._ready.wait()
            self._ready.clear()
            if not self._pending.events:
                if self._closing:
                    return
                continue
            message = self._pending
            self._pending = worker_pb2.StreamResponse()
            self._open_chunks.clear()
            try:
                await self._context.write(message)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the caller is gone; gRPC cancels the handler
                log.info("generate stream closed by the caller", error=str(exc))
                return


class _EventSink:
    """One request's messages, as events of its session (queued, never waiting)."""

    blocking = False

    def __init__(self, session: Session, request_id: str) -> None:
        self._session = session
        self._request_id = request_id

    async def chunk(self, chunk: Any) -> None:
        self._session._chunk(self._request_id, chunk)

    async def final(self, final: Any) -> None:
        self._session._final(self._request_id, final)

    async def time_limit(self, final: Any) -> None:
        self._session._final(self._request_id, final)

    async def error(self, exc: WorkerError) -> None:
        self._session._error(self._request_id, exc)


__all__ = ["Session"]
