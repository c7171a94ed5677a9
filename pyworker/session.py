"""`GenerateStream`: many requests over one stream, one message per engine step.

vLLM's output handler hands the outputs of one engine step to every request in one pass
of the event loop. Each request (`relay.StreamedRequest`, called by the handler itself,
with no task of its own) drops its news into the session's pending message (a request's
consecutive chunks merge into one event); the writer task runs after them and sends
everything as one `StreamResponse`. While a write is in flight the next message fills
up, so a slow reader gets fewer, larger messages and never blocks the engine. Closing
the stream (or losing the client) cancels every request on it, which aborts them in the
engine.

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

from pyworker.errors import AlreadyExists, EngineFailure, InvalidArgument, StatusError
from pyworker.generations import Generations
from pyworker.relay import StreamedRequest
from pyworker.request import deadline_after
from pyworker.served import ServedRequest

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
        # attempt id -> its request, until it is over in the engine and released
        self._requests: dict[int, StreamedRequest | ServedRequest] = {}
        self._live: set[int] = set()  # attempts whose caller still listens
        self._ending: set[asyncio.Future[None]] = set()  # cancelled, not released yet
        self._starts: set[asyncio.Task[None]] = set()
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
            while self._requests:
                # wait(), not gather(): a cancelled handler must not cancel these futures
                # (the requests' own), or nothing would abort the requests below.
                await asyncio.wait([r.done for r in self._requests.values()])
            self._closing = True
            self._ready.set()
            await writer
        finally:
            for attempt_id in list(self._requests):
                self._cancel(attempt_id)
            writer.cancel()
            await asyncio.gather(*self._starts, writer, return_exceptions=True)
            if self._ending:  # the aborts of this stream's requests are through
                await asyncio.wait(list(self._ending))

    def _cancel(self, attempt_id: int) -> None:
        request = self._requests.pop(attempt_id, None)
        if request is None:
            return  # unknown or over: nothing to do
        self._live.discard(attempt_id)
        request.cancel()
        if not request.done.done():
            self._ending.add(request.done)  # awaited before the stream ends
            request.done.add_done_callback(self._ending.discard)
        self._forget(attempt_id)

    def _start(self, request: Any) -> None:
        arrived = time.monotonic()
        attempt_id = int(request.attempt_id)
        try:
            if attempt_id == 0:
                raise InvalidArgument.for_field(
                    "attempt_id", "required (nonzero) on GenerateStream"
                )
            if attempt_id in self._requests:
                raise AlreadyExists(f"attempt_id {attempt_id} is already open on this stream")
            # Unique for every start, even one reusing the attempt id of a cancelled
            # attempt whose abort is still on its way to the engine.
            engine_id = (
                f"{request.request_id or 'request'}@{self._number}.{attempt_id}.{next(self._seq)}"
            )
            state, parsed = self._generations.admit(request, engine_id)
        except StatusError as exc:
            self._error(attempt_id, exc)
            return
        except Exception as exc:  # a bug of ours: this attempt fails, the stream goes on
            log.error("generate start failed", attempt_id=attempt_id, exc_info=exc)
            self._error(attempt_id, EngineFailure(f"worker error: {exc!r}"))
            return
        deadline = deadline_after(request.timeout_ms / 1000.0) if request.timeout_ms else None
        # A beam search answers once, at the end: a task of its own, nothing to batch.
        kind = ServedRequest if parsed.beam_width > 1 else StreamedRequest
        streamed = kind(
            self._generations, parsed, state, _EventSink(self, attempt_id), arrived, deadline
        )
        self._requests[attempt_id] = streamed
        self._live.add(attempt_id)
        streamed.done.add_done_callback(lambda _: self._over(attempt_id, streamed))
        task = asyncio.create_task(streamed.start(), name=state.request_id)
        self._starts.add(task)
        task.add_done_callback(self._starts.discard)

    def _over(self, attempt_id: int, request: StreamedRequest | ServedRequest) -> None:
        if self._requests.get(attempt_id) is request:
            del self._requests[attempt_id]

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
            if e.HasField("chunk") and e.attempt_id in self._live
        }

    # ---- the pending message ---------------------------------------------------------

    def _chunk(
        self,
        attempt_id: int,
        token_ids: list[int],
        logprobs: list[Any] | None,
        prompt: list[Any] | None = None,
    ) -> None:
        if attempt_id not in self._live:
            return
        chunk = self._open_chunks.get(attempt_id)
        if chunk is None:
            event = self._pending.events.add()
            event.attempt_id = attempt_id
            chunk = event.chunk
            self._open_chunks[attempt_id] = chunk
        chunk.token_ids.extend(token_ids)  # a request's consecutive chunks merge
        if logprobs:
            chunk.logprobs.extend(logprobs)
        if prompt:
            chunk.prompt_logprobs.extend(prompt)
        self._ready.set()

    def _final(self, attempt_id: int, final: Any) -> None:
        if attempt_id not in self._live:
            return
        self._live.discard(attempt_id)
        self._pending.events.add(attempt_id=attempt_id, final=final)
        self._open_chunks.pop(attempt_id, None)
        self._ready.set()

    def _error(self, attempt_id: int, exc: StatusError) -> None:
        """An error event: the attempt's own (the sink ends it), or a start refused (which
        leaves an open attempt with the same id alone)."""
        error = worker_pb2.StreamError(
            code=exc.code.value[0],
            message=exc.message,
            field_violations=[
                worker_pb2.FieldViolation(field=v.field, description=v.description)
                for v in exc.violations
            ],
        )
        self._pending.events.add(attempt_id=attempt_id, error=error)
        if attempt_id not in self._live:
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

    __slots__ = ("_attempt_id", "_session")

    def __init__(self, session: Session, attempt_id: int) -> None:
        self._session = session
        self._attempt_id = attempt_id

    def chunk(
        self, token_ids: list[int], logprobs: list[Any] | None, prompt: list[Any] | None = None
    ) -> None:
        self._session._chunk(self._attempt_id, token_ids, logprobs, prompt)

    def final(self, final: Any) -> None:
        self._session._final(self._attempt_id, final)

    def error(self, exc: StatusError) -> None:
        if self._attempt_id in self._session._live:
            self._session._live.discard(self._attempt_id)
            self._session._error(self._attempt_id, exc)


__all__ = ["Session"]
