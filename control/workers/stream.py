"""The control plane's side of `GenerateStream`: every request to one worker over one
stream.

A worker sends the news of all its requests in one message per engine step, so the
control plane reads one message per step instead of one per token of every request, and
sends its starts and cancels batched the same way. Each attempt is keyed by an id this
session assigns (never reused on the stream), so a retry never meets the events of the
attempt it replaces. Each attempt sees a `StreamCall`: an async iterator of events
(chunks, then one final) with `cancel()` and `done()`, like the `Generate` call it
replaces. A cancel of an attempt whose start is not sent yet takes the start back.

When the stream breaks (the reader sees an error, or the writer fails), every attempt on
it fails with `WorkerCallFailed(LOST)`; the next request opens a new stream.

Backpressure: an attempt holds at most `max_buffered_tokens` unread tokens. When its
reader falls further behind, the session stops reading the stream (HTTP/2 flow control
then holds the worker's writes, and the worker merges its tokens into fewer messages)
until that reader catches up, for at most `slow_reader_grace_s`; after that the attempt
is cancelled on the worker and fails with SLOW_READER, and the stream reads on.

The native direct path: when the session reads the worker's messages as bytes (`raw`)
and an attempt's direct handler hands it over (`DirectHandler.handover`: the native
front can make its next chunks itself), each message goes through the front first
(`NativeFeed.feed`), which writes the chunks of the attempts handed over and returns the
rest. An attempt comes back, with the tokens the front wrote (`adopt`), before any event
of it that the front leaves to Python, and when it ends here (cancel, failure).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
import structlog
from switchyard.front.v1 import front_pb2
from switchyard.worker.v1 import worker_pb2

from control.metrics import FRONT_DIRECT_TOKENS
from control.workers.call import FailureKind, WorkerCallFailed
from switchyard_common.rpc_status import FieldViolation

log = structlog.get_logger(__name__)

_STATUS_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}
MAX_BUFFERED_TOKENS = 8192
SLOW_READER_GRACE_S = 10.0
MAX_TIMEOUT_MS = 2**32 - 1  # GenerateRequest.timeout_ms is a uint32
_session_ids = itertools.count(1)  # a session's id on the native front (never reused)


class NativeFeed(Protocol):
    """The native front's direct path (control.api.front_lib.FrontLib)."""

    def direct_start(
        self, stream: int, attempt: int, call: int, vocab: int, pending: bytes, last_at: float
    ) -> bool: ...

    def direct_stop(self, stream: int, attempt: int) -> bytes: ...

    def feed(self, stream: int, raw: bytes) -> bytes: ...


@dataclass(frozen=True, slots=True)
class Handover:
    """What the native front needs to make an attempt's next chunks itself."""

    feed: NativeFeed
    call: int  # the public call's id on the front
    vocab: int  # the vocabulary's handle on the front
    pending: bytes  # the start of a character not finished yet
    last_token_at: float  # time.perf_counter() of the last token
    observe_itl: Callable[[float], None]  # the inter-token latency histogram
    count_tokens: Callable[[int], None]  # the generated-token counter


class DirectHandler(Protocol):
    """Takes an attempt's chunks where they arrive (control.request.direct.DirectChunks)."""

    def __call__(self, chunk: Any) -> bool:
        """Write the chunk's public chunk now; False (nothing done) to leave it queued."""
        ...

    def handover(self) -> Handover | None:
        """When the native front can make the next chunks: what it needs."""
        ...

    def adopt(self, token_ids: Sequence[int], last_token_at: float) -> None:
        """The tokens the native front wrote while it had the attempt."""
        ...


class StreamCall:
    """One attempt's events on a session."""

    __slots__ = (
        "_buffered",
        "_drained",
        "_events",
        "_failure",
        "_finished",
        "_native",
        "_session",
        "_timer",
        "_waiter",
        "attempt_id",
        "direct",
    )

    def __init__(self, session: StreamSession, attempt_id: int) -> None:
        self._session = session
        self.attempt_id = attempt_id
        self._events: deque[Any] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._drained: asyncio.Future[None] | None = None
        self._failure: BaseException | None = None
        self._finished = False
        self._timer: asyncio.TimerHandle | None = None
        self._buffered = 0  # unread tokens
        # Takes a chunk where it arrives, in the reader's turn (control.request.direct);
        # returns False to leave it to the queue. Only while nothing waits in the queue.
        self.direct: DirectHandler | None = None
        # The handler whose attempt the native front has (its chunks made there).
        self._native: DirectHandler | None = None

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
        if event.HasField("chunk"):
            self._buffered -= len(event.chunk.token_ids)
            drained = self._drained
            if drained is not None and not drained.done():
                drained.set_result(None)
        if event.HasField("error"):
            error = event.error
            raise WorkerCallFailed.from_status(
                self._session.address,
                _STATUS_BY_NUMBER.get(error.code, grpc.StatusCode.UNKNOWN),
                error.message,
                tuple(_violations(error)),
                error.retry_after_ms / 1000.0 if error.retry_after_ms else None,
            )
        return event

    def done(self) -> bool:
        return self._finished or self._failure is not None

    def cancel(self) -> bool:
        """Stop listening and abort the attempt on the worker; a reader waiting on this
        call gets CancelledError, as with a cancelled gRPC call."""
        if self.done():
            return False
        self._take_back()
        self._session.cancel(self.attempt_id)
        self._fail(asyncio.CancelledError())
        return True

    # ---- fed by the session ----------------------------------------------------------

    def _push(self, event: Any, is_chunk: bool) -> None:
        direct = self.direct
        if is_chunk and direct is not None and not self._events:
            try:
                if direct(event.chunk):
                    if self._native is None and self._session.raw:
                        # After the rest of this message, which is Python's to handle.
                        self._session.handovers.append(self)
                    return
            except Exception as exc:  # as if the reader had raised it: the request fails
                self._session.cancel(self.attempt_id)  # and the worker stops generating
                self._fail(exc)
                return
            self.direct = None
        self._events.append(event)
        if is_chunk:
            self._buffered += len(event.chunk.token_ids)
        else:  # a final or an error: nothing follows
            self._end()
        self._wake()

    def _hand_over(self) -> None:
        """The native front makes this attempt's next chunks, when it can."""
        direct = self.direct
        if direct is None or self._native is not None or self._events or self.done():
            return
        handover = direct.handover()
        if handover is None:
            return
        session = self._session
        if handover.feed.direct_start(
            session.id,
            self.attempt_id,
            handover.call,
            handover.vocab,
            handover.pending,
            handover.last_token_at,
        ):
            self._native = direct
            session.native_started(handover)

    def _take_back(self) -> None:
        """The attempt back from the native front, with the tokens it wrote (if it had it)."""
        if self._native is not None:
            raw = self._session.native_stop(self.attempt_id)
            self._handed_back(front_pb2.Handback.FromString(raw))

    def _handed_back(self, back: Any) -> None:
        """The native front gave the attempt back (its next event is Python's)."""
        native, self._native = self._native, None
        if native is not None and back.token_ids:
            native.adopt(back.token_ids, back.last_token_at)

    def _fail(self, exc: BaseException) -> None:
        self._take_back()
        self.direct = None
        if not self.done():
            self._failure = exc
            self._end()
        self._wake()

    def _expire(self) -> None:
        """The worker never answered within the deadline (hung, or too slow to say so)."""
        self._timer = None
        if not self.done():
            self._session.cancel(self.attempt_id)
            self._fail(
                WorkerCallFailed(
                    FailureKind.DEADLINE,
                    self._session.address,
                    "deadline exceeded",
                    code=grpc.StatusCode.DEADLINE_EXCEEDED,
                )
            )

    def _end(self) -> None:
        self._finished = True
        self.direct = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        drained = self._drained
        if drained is not None and not drained.done():
            drained.set_result(None)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


def _violations(error: Any) -> list[FieldViolation]:
    return [FieldViolation(v.field, v.description) for v in error.field_violations]


class StreamSession:
    """One GenerateStream to one worker, opened on first use and reopened after a break."""

    def __init__(
        self,
        stub: Any,
        address: str,
        *,
        max_buffered_tokens: int = MAX_BUFFERED_TOKENS,
        slow_reader_grace_s: float = SLOW_READER_GRACE_S,
        on_break: Callable[[], None] = lambda: None,
        raw_stream: Callable[[], Any] | None = None,
    ) -> None:
        """`raw_stream`: opens GenerateStream with messages read as bytes, parsed here
        (the native direct path needs them so); else `stub.GenerateStream` parses them."""
        self._stub = stub
        self._on_break = on_break
        self._raw_stream = raw_stream
        self.raw = raw_stream is not None
        self.id = next(_session_ids)
        self.address = address
        # The native front's direct path, once an attempt is handed over to it.
        self._feed: NativeFeed | None = None
        self._observe_itl: Callable[[float], None] = lambda _: None
        self._count_tokens: Callable[[int], None] = lambda _: None
        self._handed = 0  # attempts the native front has now
        self.handovers: list[StreamCall] = []  # to hand over after the message at hand
        self.max_buffered_tokens = max_buffered_tokens
        self.slow_reader_grace_s = slow_reader_grace_s
        self._call: Any = None
        self._calls: dict[int, StreamCall] = {}
        self._ids = itertools.count(1)  # attempt ids: never reused on this session
        self._starts: dict[int, worker_pb2.GenerateRequest] = {}  # not sent yet
        self._cancels: list[int] = []
        self._send = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def open_calls(self) -> int:
        return len(self._calls)

    def open(self, request: worker_pb2.GenerateRequest, timeout: float | None) -> StreamCall:
        """Start `request` as a new attempt (its request_id is for logs only)."""
        if self._call is None:
            self._connect()
        attempt_id = next(self._ids)
        request.attempt_id = attempt_id
        call = StreamCall(self, attempt_id)
        if timeout is not None and timeout * 1000 < MAX_TIMEOUT_MS:  # beyond: no deadline
            request.timeout_ms = max(1, int(timeout * 1000))
            call._timer = asyncio.get_running_loop().call_later(timeout, call._expire)
        self._calls[attempt_id] = call
        self._starts[attempt_id] = request
        self._send.set()
        return call

    def cancel(self, attempt_id: int) -> None:
        if self._calls.pop(attempt_id, None) is None or self._call is None:
            return
        if self._starts.pop(attempt_id, None) is None:  # sent already: the worker aborts it
            self._cancels.append(attempt_id)
            self._send.set()

    async def close(self) -> None:
        self._break(FailureKind.LOST, "the worker connection was closed")

    def native_started(self, handover: Handover) -> None:
        self._feed = handover.feed
        self._observe_itl = handover.observe_itl
        self._count_tokens = handover.count_tokens
        self._handed += 1

    def native_stop(self, attempt_id: int) -> bytes:
        """Takes an attempt back from the native front: its serialized Handback."""
        if self._feed is None:
            return b""
        raw = self._feed.direct_stop(self.id, attempt_id)
        if raw:
            self._handed -= 1
        return raw

    def _parse(self, raw: bytes) -> Any:
        """A worker message read as bytes: through the native front while it has
        attempts of this stream (their chunks written there), the rest parsed here."""
        feed = self._feed
        if feed is None or self._handed <= 0:
            return worker_pb2.StreamResponse.FromString(raw)
        result = front_pb2.FeedResult.FromString(feed.feed(self.id, raw))
        if result.tokens:  # one worker's, so one model's
            FRONT_DIRECT_TOKENS.inc(result.tokens)
            self._count_tokens(result.tokens)
            observe = self._observe_itl
            for seconds in result.itl:
                observe(seconds)
        calls = self._calls
        for back in result.handbacks:
            self._handed -= 1
            target = calls.get(back.attempt)
            if target is not None:
                target._handed_back(back)
        return worker_pb2.StreamResponse.FromString(result.rest)

    def _connect(self) -> None:
        opener = self._raw_stream or self._stub.GenerateStream
        call = opener()
        self._call = call
        self._tasks = [
            asyncio.create_task(self._read(call), name=f"stream reader {self.address}"),
            asyncio.create_task(self._write(call), name=f"stream writer {self.address}"),
        ]

    async def _write(self, call: Any) -> None:
        try:
            while True:
                await self._send.wait()
                self._send.clear()
                if not self._starts and not self._cancels:
                    continue
                message = worker_pb2.StreamRequest(
                    start=self._starts.values(), cancel=self._cancels
                )
                self._starts, self._cancels = {}, []
                await call.write(message)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # Whatever broke the write, the attempts on this stream can hear nothing more:
            # fail them now rather than let them wait for a reader that may never end.
            if call is self._call:
                log.warning("generate stream write failed", worker=self.address, error=str(exc))
                self._break(FailureKind.LOST, f"writing to the worker failed: {exc}")

    async def _read(self, call: Any) -> None:
        calls = self._calls
        kind, details = FailureKind.LOST, "the worker ended the stream"
        try:
            async for message in call:
                if self.raw:
                    message = self._parse(message)
                behind: list[StreamCall] = []
                for event in message.events:
                    target = calls.get(event.attempt_id)
                    if target is None:
                        continue  # cancelled meanwhile, or a start taken back
                    is_chunk = event.HasField("chunk")
                    if not is_chunk:
                        del calls[event.attempt_id]
                    target._push(event, is_chunk)
                    if target._buffered > self.max_buffered_tokens:
                        behind.append(target)
                if self.handovers:
                    for target in self.handovers:
                        target._hand_over()
                    self.handovers.clear()
                # The whole message is delivered first; then the stream waits (reads no
                # more) for the readers that are too far behind.
                for target in behind:
                    if not target.done():
                        await self._wait_for_reader(target)
        except asyncio.CancelledError:
            details = "the worker connection was closed"
        except grpc.aio.AioRpcError as exc:
            details = f"{exc.code().name}: {exc.details() or ''}"
            if exc.code() == grpc.StatusCode.CANCELLED:
                details = "the worker connection was closed"
        except grpc.aio.UsageError as exc:
            details = str(exc)
        except Exception as exc:  # a message that did not parse, a bug: the stream is gone
            log.error("generate stream reader failed", worker=self.address, exc_info=exc)
            details = f"reading from the worker failed: {exc!r}"
        if call is self._call:
            log.warning("generate stream broke", worker=self.address, error=details)
            self._break(kind, details)

    async def _wait_for_reader(self, target: StreamCall) -> None:
        """Backpressure: hold the stream while `target`'s reader catches up; give up on
        the attempt after the grace."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.slow_reader_grace_s
        while target._buffered > self.max_buffered_tokens and not target.done():
            target._drained = loop.create_future()
            try:
                async with asyncio.timeout_at(deadline):
                    await target._drained
            except TimeoutError:
                log.warning(
                    "reader too slow; cancelling its request",
                    worker=self.address,
                    unread_tokens=target._buffered,
                )
                self._calls.pop(target.attempt_id, None)
                self._cancels.append(target.attempt_id)
                self._send.set()
                target._events.clear()
                target._buffered = 0
                target._fail(
                    WorkerCallFailed(
                        FailureKind.SLOW_READER,
                        self.address,
                        f"more than {self.max_buffered_tokens} tokens were left unread for "
                        f"{self.slow_reader_grace_s:g} s",
                    )
                )
                return
            finally:
                target._drained = None

    def _break(self, kind: FailureKind, details: str) -> None:
        """Fail every open call and forget the stream; the next request opens a new one."""
        call, self._call = self._call, None
        tasks, self._tasks = self._tasks, []
        calls, self._calls = self._calls, {}
        self._starts, self._cancels = {}, []
        for task in tasks:
            if task is not asyncio.current_task():
                task.cancel()
        if call is not None:
            with contextlib.suppress(Exception):
                call.cancel()
        if calls:
            self._on_break()  # one break is one failure of the worker, however many calls
        for stream in calls.values():
            stream._fail(WorkerCallFailed(kind, self.address, details, counted=True))
        # Each was taken back from the native front above; none of this stream's attempts
        # is left there (attempt ids are never reused, so none could be met again).
        self._handed = 0
