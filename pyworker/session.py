"""`GenerateStream`: many requests over one stream, one message per engine step.

vLLM hands the outputs of one engine step to every request's `generate()` in one pass
of the event loop. Each request's task drops its news into the session's pending message
(a request's consecutive chunks merge into one event); the writer task runs after them
and sends everything as one `StreamResponse`. While a write is in flight the next
message fills up, so a slow reader gets fewer, larger messages and never blocks the
engine. Closing the stream (or losing the client) cancels every request on it, which
aborts them in the engine.

Requests are keyed by the attempt id the control plane gives each start. A message's
cancels are handled before its starts, and a start that the same message cancels is never
started. Once an attempt is cancelled nothing more is sent for it, even what was queued.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from switchyard.worker.v1 import worker_pb2

from pyworker.errors import AlreadyExists, EngineFailure, InvalidArgument, WorkerError
from pyworker.generation import Generations
from pyworker.load import InFlight
from pyworker.request import deadline_after

log = structlog.get_logger(__name__)

_sessions = itertools.count(1)  # engine request ids stay unique across streams


class Session:
    """One GenerateStream call; `write` sends one message to its caller."""

    def __init__(self, generations: Generations, write: Callable[[Any], Awaitable[None]]) -> None:
        self._generations = generations
        self._write = write
        self._number = next(_sessions)
        self._pending = worker_pb2.StreamResponse()
        self._open_chunks: dict[int, Any] = {}  # attempt id -> its chunk in _pending
        self._ready = asyncio.Event()
        self._closing = False
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._cancelled: set[asyncio.Task[None]] = set()
        self._seq = itertools.count(1)

    async def run(self, request_iterator: Any) -> None:
        writer = asyncio.create_task(self._write_loop(), name="generate-stream writer")
        try:
            async for message in request_iterator:
                cancelled = set(message.cancel)
                for attempt_id in cancelled:
                    self._cancel(attempt_id)
                for request in message.start:
                    if request.attempt_id not in cancelled:  # given up before it was sent
                        self._start(request)
            # The caller closed its side: finish what runs, send the rest, then end.
            while self._tasks:
                await asyncio.gather(*self._tasks.values(), return_exceptions=True)
            self._closing = True
            self._ready.set()
            await writer
        finally:
            tasks = list(self._tasks.values())
            for task in tasks:
                task.cancel()
            writer.cancel()
            await asyncio.gather(*tasks, *self._cancelled, writer, return_exceptions=True)

    def _cancel(self, attempt_id: int) -> None:
        task = self._tasks.pop(attempt_id, None)
        if task is None:
            return  # unknown or over: nothing to do
        task.cancel()  # its done-callback releases it
        self._cancelled.add(task)  # awaited before the stream ends
        task.add_done_callback(self._cancelled.discard)
        self._forget(attempt_id)

    def _start(self, request: Any) -> None:
        arrived = time.monotonic()
        attempt_id = int(request.attempt_id)
        try:
            if attempt_id == 0:
                raise InvalidArgument.field("attempt_id", "required (nonzero) on GenerateStream")
            if attempt_id in self._tasks:
                raise AlreadyExists(f"attempt_id {attempt_id} is already open on this stream")
            # Unique for every start, even one reusing the attempt id of a cancelled
            # attempt whose abort is still on its way to the engine.
            engine_id = (
                f"{request.request_id or 'request'}@{self._number}.{attempt_id}.{next(self._seq)}"
            )
            state, parsed = self._generations.admit(request, engine_id)
        except WorkerError as exc:
            self._error(attempt_id, exc)
            return
        except Exception as exc:  # a bug of ours: this attempt fails, the stream goes on
            log.error("generate start failed", attempt_id=attempt_id, exc_info=exc)
            self._error(attempt_id, EngineFailure(f"worker error: {exc!r}"))
            return
        deadline = deadline_after(request.timeout_ms / 1000.0) if request.timeout_ms else None
        sink = _EventSink(self, attempt_id)
        task = asyncio.create_task(
            self._generations.serve(parsed, state, sink, arrived, deadline),
            name=state.request_id,
        )
        self._tasks[attempt_id] = task
        task.add_done_callback(lambda t: self._finished(attempt_id, t, state))

    def _finished(self, attempt_id: int, task: asyncio.Task[None], state: InFlight) -> None:
        if self._tasks.get(attempt_id) is task:
            del self._tasks[attempt_id]
        # A task cancelled before it ran never reached serve()'s own clean-up.
        self._generations.release(state)

    def _forget(self, attempt_id: int) -> None:
        """Drop what is queued for a cancelled attempt: its caller listens no more. A live
        attempt can only have its open chunk queued (a final or an error ends it)."""
        if self._open_chunks.pop(attempt_id, None) is None:
            return
        events = self._pending.events
        for i in reversed(range(len(events))):  # in place: the open chunks stay the ones sent
            if events[i].attempt_id == attempt_id:
                del events[i]
        self._open_chunks = {
            e.attempt_id: e.chunk
            for e in events
            if e.HasField("chunk") and e.attempt_id in self._tasks
        }

    # ---- the pending message ---------------------------------------------------------

    def _live(self, attempt_id: int) -> bool:
        return attempt_id in self._tasks

    def _chunk(self, attempt_id: int, chunk: Any) -> None:
        if not self._live(attempt_id):
            return
        open_chunk = self._open_chunks.get(attempt_id)
        if open_chunk is not None:
            open_chunk.MergeFrom(chunk)  # repeated fields append
        else:
            event = self._pending.events.add(attempt_id=attempt_id, chunk=chunk)
            self._open_chunks[attempt_id] = event.chunk
        self._ready.set()

    def _final(self, attempt_id: int, final: Any) -> None:
        if not self._live(attempt_id):
            return
        self._pending.events.add(attempt_id=attempt_id, final=final)
        self._open_chunks.pop(attempt_id, None)
        self._ready.set()

    def _error(self, attempt_id: int, exc: WorkerError) -> None:
        error = worker_pb2.StreamError(
            code=exc.code.value[0],
            message=exc.message,
            field_violations=[
                worker_pb2.FieldViolation(field=v.field, description=v.description)
                for v in exc.violations
            ],
        )
        self._pending.events.add(attempt_id=attempt_id, error=error)
        self._open_chunks.pop(attempt_id, None)
        self._ready.set()

    async def _write_loop(self) -> None:
        while True:
            # The state is checked before waiting: the last events may be queued, and the
            # stream begin to close, before this task wakes; nothing wakes it after that.
            if not self._pending.events:
                if self._closing:
                    return
                await self._ready.wait()
                self._ready.clear()
                continue
            message = self._pending
            self._pending = worker_pb2.StreamResponse()
            self._open_chunks.clear()
            try:
                await self._write(message)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the caller is gone; gRPC cancels the handler
                log.info("generate stream closed by the caller", error=str(exc))
                return


class _EventSink:
    """One attempt's messages, as events of its session (queued, never waiting)."""

    blocking = False

    def __init__(self, session: Session, attempt_id: int) -> None:
        self._session = session
        self._attempt_id = attempt_id

    async def chunk(self, chunk: Any) -> None:
        self._session._chunk(self._attempt_id, chunk)

    async def final(self, final: Any) -> None:
        self._session._final(self._attempt_id, final)

    async def time_limit(self, final: Any) -> None:
        self._session._final(self._attempt_id, final)

    async def error(self, exc: WorkerError) -> None:
        if self._session._live(self._attempt_id):
            self._session._error(self._attempt_id, exc)


__all__ = ["Session"]
