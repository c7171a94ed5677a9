"""The control plane's side of `GenerateStream`: every request to one worker over one
stream.

A worker sends the news of all its requests in one message per engine step, so the
control plane reads one message per step instead of one per token of every request, and
sends its starts and cancels batched the same way. Each request sees a `StreamCall`:
an async iterator of events (chunks, then one final) with `cancel()` and `done()`, like
the `Generate` call it replaces. When the stream breaks, every request on it fails with
UNAVAILABLE and fails over; the next request opens a new stream.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from typing import Any

import grpc
import structlog
from switchyard.worker.v1 import worker_pb2

log = structlog.get_logger(__name__)

_STATUS_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


class WorkerCallError(Exception):
    """A request on a GenerateStream failed; shaped like `grpc.aio.AioRpcError`."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class StreamCall:
    """One request's events on a session."""

    __slots__ = ("_events", "_failure", "_finished", "_session", "_timer", "_waiter", "request_id")

    def __init__(self, session: StreamSession, request_id: str) -> None:
        self._session = session
        self.request_id = request_id
        self._events: deque[Any] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._failure: BaseException | None = None
        self._finished = False
        self._timer: asyncio.TimerHandle | None = None

    def __aiter__(self) -> StreamCall:
        return self

    async def __anext__(self) -> Any:
        while not self._events:
            if self._failure is not None:
                raise self._failure
            if self._finished:
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        events = self._events
        event = events.popleft()
        if events and event.HasField("chunk"):
            # Behind the worker: the chunks that are ready go out as one message.
            chunk = event.chunk
            while events and events[0].HasField("chunk"):
                chunk.MergeFrom(events.popleft().chunk)
        if event.HasField("error"):
            raise WorkerCallError(
                _STATUS_BY_NUMBER.get(event.error.code, grpc.StatusCode.UNKNOWN),
                event.error.message,
            )
        return event

    def done(self) -> bool:
        return self._finished or self._failure is not None

    def cancel(self) -> bool:
        """Stop listening and abort the request on the worker; a reader waiting on this
        call gets CancelledError, as with a cancelled gRPC call."""
        if self.done():
            return False
        self._session.cancel(self.request_id)
        self._fail(asyncio.CancelledError())
        return True

    # ---- fed by the session ----------------------------------------------------------

    def _push(self, event: Any) -> None:
        self._events.append(event)
        if not event.HasField("chunk"):  # a final or an error: nothing follows
            self._end()
        self._wake()

    def _fail(self, exc: BaseException) -> None:
        if not self.done():
            self._failure = exc
            self._end()
        self._wake()

    def _expire(self) -> None:
        """The worker never answered within the deadline (hung, or too slow to say so)."""
        self._timer = None
        if not self.done():
            self._session.cancel(self.request_id)
            self._fail(WorkerCallError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded"))

    def _end(self) -> None:
        self._finished = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class StreamSession:
    """One GenerateStream to one worker, opened on first use and reopened after a break."""

    def __init__(self, stub: Any, address: str) -> None:
        self._stub = stub
        self._address = address
        self._call: Any = None
        self._calls: dict[str, StreamCall] = {}
        self._outgoing = worker_pb2.StreamRequest()
        self._send = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def open_calls(self) -> int:
        return len(self._calls)

    def open(self, request: Any, timeout: float | None) -> StreamCall:
        """Start `request` (its request_id must be unique among open calls)."""
        if self._call is None:
            self._connect()
        call = StreamCall(self, request.request_id)
        if request.request_id in self._calls:  # its events would mix with the other's
            call._fail(
                WorkerCallError(
                    grpc.StatusCode.ALREADY_EXISTS,
                    f"request_id {request.request_id!r} is already in flight",
                )
            )
            return call
        self._calls[request.request_id] = call
        if timeout is not None:
            request.timeout_ms = max(1, int(timeout * 1000))
            call._timer = asyncio.get_running_loop().call_later(timeout, call._expire)
        self._outgoing.start.append(request)
        self._send.set()
        return call

    def cancel(self, request_id: str) -> None:
        if self._calls.pop(request_id, None) is not None and self._call is not None:
            self._outgoing.cancel.append(request_id)
            self._send.set()

    async def close(self) -> None:
        self._break(grpc.StatusCode.UNAVAILABLE, "the worker connection was closed")

    def _connect(self) -> None:
        call = self._stub.GenerateStream()
        self._call = call
        self._tasks = [
            asyncio.create_task(self._read(call), name=f"stream reader {self._address}"),
            asyncio.create_task(self._write(call), name=f"stream writer {self._address}"),
        ]

    async def _write(self, call: Any) -> None:
        try:
            while True:
                await self._send.wait()
                self._send.clear()
                message, self._outgoing = self._outgoing, worker_pb2.StreamRequest()
                if message.start or message.cancel:
                    await call.write(message)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the reader sees the same break and reports it
            log.debug("generate stream write failed", worker=self._address, error=str(exc))

    async def _read(self, call: Any) -> None:
        calls = self._calls
        code, details = grpc.StatusCode.UNAVAILABLE, "the worker ended the stream"
        try:
            async for message in call:
                for event in message.events:
                    target = calls.get(event.request_id)
                    if target is None:
                        continue  # cancelled meanwhile
                    if not event.HasField("chunk"):
                        del calls[event.request_id]
                    target._push(event)
        except asyncio.CancelledError:
            code, details = grpc.StatusCode.CANCELLED, "the worker connection was closed"
        except grpc.aio.AioRpcError as exc:
            code, details = exc.code(), exc.details() or ""
            if code == grpc.StatusCode.CANCELLED:
                details = "the worker connection was closed"
        except grpc.aio.UsageError as exc:
            code, details = grpc.StatusCode.CANCELLED, str(exc)
        if call is self._call:
            log.warning("generate stream broke", worker=self._address, code=code.name)
            self._break(code, details)

    def _break(self, code: grpc.StatusCode, details: str) -> None:
        """Fail every open call and forget the stream; the next request opens a new one."""
        call, self._call = self._call, None
        tasks, self._tasks = self._tasks, []
        calls, self._calls = self._calls, {}
        self._outgoing = worker_pb2.StreamRequest()
        for task in tasks:
            if task is not asyncio.current_task():
                task.cancel()
        if call is not None:
            with contextlib.suppress(Exception):
                call.cancel()
        error = WorkerCallError(code, f"worker {self._address}: {details}")
        for stream in calls.values():
            stream._fail(error)
