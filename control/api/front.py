"""The public port on the native front (`api.front: native`): grpc++ carries the bytes,
this module makes every decision.

The front (runtime_cpp/src/front/, loaded by control.api.front_lib) turns each call into
events that arrive here in batches: a call started (method, metadata, peer, deadline), a
request message, the client's half-close, a write acknowledged, a cancel. Each call runs
the handler grpc.aio would run, the same object, registered through the same `Wire`
and behind the same interceptors, with a `FrontCall` as its context: the subset of
`grpc.aio.ServicerContext` that Switchyard's handlers use. What handlers write and how
calls end goes back as commands, in one batch per turn of the event loop.

So a streamed token costs Python the handler's own work and a message appended to the
turn's batch; the per-message work of a gRPC stack (operations, completion queues, the
poller thread and its hand-offs to the loop) runs in C++ on grpc's threads.

Flow control: when a call has many messages not yet sent (a client that reads slowly),
the front says it is `full`, and its handler's next write waits until the front says
`drained`, as grpc.aio's awaited write would; the direct path (control.request.direct)
then declines its chunks. A call that keeps up costs no such news.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
import weakref
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import Any, NamedTuple, NoReturn

import grpc
import structlog
from switchyard.front.v1 import front_pb2

from control.api.front_lib import FrontLib
from control.text.detokenizer import Vocabulary

log = structlog.get_logger(__name__)

DETAILS_KEY = "grpc-status-details-bin"
_EOF: Any = grpc.aio.EOF  # type: ignore[attr-defined]
Handler = Any  # grpc.RpcMethodHandler


class HandlerTable:
    """Stands in for a grpc.aio server while services register (`Wire.add`): keeps each
    method's handler by its full name."""

    def __init__(self) -> None:
        self.handlers: dict[str, Handler] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass  # the same handlers come to add_registered_method_handlers

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Handler]) -> None:
        for name, handler in handlers.items():
            self.handlers[f"/{service}/{name}"] = handler


class _Details(NamedTuple):  # grpc.HandlerCallDetails, for interceptors
    method: str
    invocation_metadata: tuple[tuple[str, str | bytes], ...]


class FrontCall:
    """One call on the front; its handler's `context`."""

    __slots__ = (
        "_cancelled",
        "_deadline",
        "_front",
        "_full",
        "_half_closed",
        "_messages",
        "_metadata",
        "_peer",
        "_reading",
        "_waiter",
        "code",
        "details",
        "id",
        "method",
        "serializer",
        "task",
        "trailers",
    )

    def __init__(self, front: NativeFront, call_id: int, started: Any) -> None:
        self._front = front
        self.id = call_id
        self.method: str = started.method
        self._metadata = tuple(
            (e.key, e.value if e.key.endswith("-bin") else e.value.decode(errors="replace"))
            for e in started.metadata
        )
        self._peer: str = started.peer
        self._deadline: float | None = (
            time.monotonic() + started.deadline_ms / 1000.0
            if started.HasField("deadline_ms")
            else None
        )
        self._messages: deque[bytes] = deque()
        self._half_closed = False
        self._reading = True  # the front reads the first message unasked
        self._cancelled = False
        self._waiter: asyncio.Future[None] | None = None
        self._full = False  # the front holds too many of its messages
        self.serializer: Callable[[Any], bytes] | None = None
        self.task: asyncio.Task[None] | None = None
        self.code = grpc.StatusCode.OK
        self.details = ""
        self.trailers: Sequence[tuple[str, str | bytes]] = ()

    # ---- grpc.aio.ServicerContext, as far as the handlers use it ------------------------

    def invocation_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        return self._metadata

    def peer(self) -> str:
        return self._peer

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else self._deadline - time.monotonic()

    def cancelled(self) -> bool:
        return self._cancelled

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details

    def set_trailing_metadata(self, metadata: Sequence[tuple[str, str | bytes]]) -> None:
        self.trailers = tuple(metadata)

    async def abort(
        self,
        code: grpc.StatusCode,
        details: str = "",
        trailing_metadata: Sequence[tuple[str, str | bytes]] = (),
    ) -> NoReturn:
        self.code, self.details = code, details
        if trailing_metadata:
            self.trailers = tuple(trailing_metadata)
        raise grpc.aio.AbortError()

    async def read(self) -> Any:
        """The next request message's bytes, or `grpc.aio.EOF` after the last."""
        while not self._messages:
            if self._half_closed or self._cancelled:
                return _EOF
            if not self._reading:
                self._reading = True
                self._front.command(self.id).read = True
            await self._wait()
        return self._messages.popleft()

    async def write(self, message: Any) -> None:
        while self._full and not self._cancelled:
            await self._wait()
        self.write_now(message)

    # ---- control.request.direct.ChunkSink: chunks written where they arrive -------------

    def ready(self) -> bool:
        return not self._full and not self._cancelled

    def write_now(self, message: Any) -> None:
        if isinstance(message, bytes):
            data = message
        else:
            assert self.serializer is not None
            data = self.serializer(message)
        self._front.write(self.id, data)

    def native(self, vocabulary: Vocabulary) -> tuple[FrontLib, int, int] | None:
        if self._full or self._cancelled:
            return None
        return self._front.native_target(self.id, vocabulary)

    # ---- fed by the front ---------------------------------------------------------------

    def _wait(self) -> Awaitable[None]:
        self._waiter = waiter = asyncio.get_running_loop().create_future()
        return waiter

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _take(self, event: Any, kind: str) -> None:
        if kind == "message":
            self._messages.append(event.message)
            self._reading = False
        elif kind == "full":
            self._full = True
        elif kind == "drained":
            self._full = False
        elif kind == "half_closed":
            self._half_closed = True
            self._reading = False
        else:  # cancelled, deadline_exceeded: the front has ended the call
            self._cancelled = True
            # Its task may never start (cancelled in the turn that created it): forget the
            # call here, not only when the task ends.
            self._front.forget(self.id)
            if kind == "deadline_exceeded":
                self._deadline = time.monotonic() - 1e-3
            task = self.task
            if task is not None and not task.done():
                task.cancel()
        self._wake()

    async def requests(self) -> AsyncGenerator[bytes, None]:
        while (message := await self.read()) is not _EOF:
            yield message


class NativeFront:
    """The public port: `FrontLib` plus the calls it carries, run on this event loop."""

    def __init__(
        self,
        lib: FrontLib,
        handlers: dict[str, Handler],
        interceptors: Sequence[Any] = (),
    ) -> None:
        self._lib = lib
        self._handlers = handlers
        self._interceptors = tuple(interceptors)
        self._calls: dict[int, FrontCall] = {}
        self._commands = front_pb2.FrontCommands()
        self._write_calls: list[int] = []  # this turn's writes, in order
        self._write_messages: list[bytes] = []
        self._flush_pending = False
        self._loop: asyncio.AbstractEventLoop | None = None
        # The direct path's vocabularies on the front: their handles, once made (a
        # table is built in a thread, once per vocabulary: a large one takes a while).
        # Held weakly: a model unloaded takes its vocabulary with it (the front keeps its
        # copy of the table, a few MB, for the process's life).
        self._vocabs: weakref.WeakKeyDictionary[Vocabulary, int] = weakref.WeakKeyDictionary()
        self._vocabs_building: weakref.WeakSet[Vocabulary] = weakref.WeakSet()

    @property
    def port(self) -> int:
        return self._lib.port

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._lib.event_fd, self._on_events)

    async def stop(self, grace: float) -> None:
        """No new calls; those still open after `grace` are cancelled."""
        loop = asyncio.get_running_loop()
        # The front's shutdown waits for open calls, which this loop must go on serving.
        await loop.run_in_executor(None, self._lib.shutdown, grace)
        self._on_events()  # the last news: cancels
        loop.remove_reader(self._lib.event_fd)
        calls = [c.task for c in self._calls.values() if c.task is not None]
        for task in calls:
            task.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
        self._lib.close()

    # ---- commands: one batch per turn of the loop ----------------------------------------

    def command(self, call_id: int) -> Any:
        self._flush_soon()
        return self._commands.commands.add(call=call_id)

    def write(self, call_id: int, message: bytes) -> None:
        self._flush_soon()
        self._write_calls.append(call_id)
        self._write_messages.append(message)

    def _flush_soon(self) -> None:
        if not self._flush_pending:
            self._flush_pending = True
            assert self._loop is not None
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_pending = False
        commands, self._commands = self._commands, front_pb2.FrontCommands()
        commands.write_calls.extend(self._write_calls)
        commands.write_messages.extend(self._write_messages)
        self._write_calls, self._write_messages = [], []
        self._lib.apply(commands.SerializeToString())

    # ---- the direct path in C++ (control.request.direct) ---------------------------------

    def native_target(
        self, call_id: int, vocabulary: Vocabulary
    ) -> tuple[FrontLib, int, int] | None:
        """The front, the call and the vocabulary's handle, once the vocabulary is on the
        front, this turn's commands applied first (the front's chunks come after them)."""
        handle = self._vocabs.get(vocabulary)
        if handle is None:
            self._add_vocab(vocabulary)
            return None
        if handle < 0:
            return None
        if self._flush_pending:
            self._flush()
        return self._lib, call_id, handle

    def _add_vocab(self, vocabulary: Vocabulary) -> None:
        if vocabulary in self._vocabs_building:
            return
        self._vocabs_building.add(vocabulary)
        assert self._loop is not None
        table = self._loop.run_in_executor(None, vocabulary.byte_table)
        ref = weakref.ref(vocabulary)

        def done(f: asyncio.Future[bytes]) -> None:
            held = ref()
            if held is None:  # its model is gone
                return
            self._vocabs_building.discard(held)
            error = "cancelled" if f.cancelled() else f.exception()
            if error is not None:
                log.warning("no byte table for the direct path", error=repr(error))
                self._vocabs[held] = -1
                return
            self._vocabs[held] = self._lib.vocab(f.result())

        table.add_done_callback(done)

    # ---- events ------------------------------------------------------------------------

    def _on_events(self) -> None:
        data = self._lib.poll()
        if not data:
            return
        calls = self._calls
        for event in front_pb2.FrontEvents.FromString(data).events:
            kind = event.WhichOneof("kind")
            if kind == "started":
                call = FrontCall(self, event.call, event.started)
                calls[event.call] = call
                assert self._loop is not None
                call.task = self._loop.create_task(self._serve(call))
            elif (found := calls.get(event.call)) is not None:
                found._take(event, kind)

    async def _serve(self, call: FrontCall) -> None:
        try:
            handler = await self._resolve(0, _Details(call.method, call.invocation_metadata()))
            if handler is None:
                call.code, call.details = grpc.StatusCode.UNIMPLEMENTED, "Method not found!"
            else:
                await _run(handler, call)
        except grpc.aio.AbortError:
            pass  # its status is on the call
        except asyncio.CancelledError:
            call.code = grpc.StatusCode.CANCELLED  # the front has ended it already
        except Exception as e:
            log.error("handler failed", method=call.method, exc_info=e)
            call.code, call.details = grpc.StatusCode.UNKNOWN, f"Unexpected {type(e)}: {e}"
        finally:
            self._calls.pop(call.id, None)
            if not call._cancelled:
                self._finish(call)

    async def _resolve(self, i: int, details: _Details) -> Handler | None:
        """The handler, through the interceptors in order (as grpc.aio chains them)."""
        if i == len(self._interceptors):
            return self._handlers.get(details.method)

        def next_one(d: Any) -> Awaitable[Handler | None]:
            return self._resolve(i + 1, d)

        return await self._interceptors[i].intercept_service(next_one, details)

    def _finish(self, call: FrontCall) -> None:
        finish = self.command(call.id).finish
        finish.code = call.code.value[0]
        finish.message = call.details or ""
        for key, value in call.trailers:
            raw = value if isinstance(value, bytes) else value.encode()
            if key == DETAILS_KEY:
                finish.details = raw
            else:
                finish.trailers.add(key=key, value=raw)

    def open_calls(self) -> int:
        return len(self._calls)

    def forget(self, call_id: int) -> None:
        self._calls.pop(call_id, None)


async def _run(handler: Handler, call: FrontCall) -> None:
    """Run `handler` as grpc.aio would, writing what it answers."""
    call.serializer = handler.response_serializer
    if handler.stream_stream is not None or handler.stream_unary is not None:
        inner = handler.stream_stream or handler.stream_unary
        requests = call.requests()
        async with contextlib.aclosing(requests):
            await _answer(inner(requests, call), call, handler.stream_unary is not None)
        return
    raw = await call.read()
    if raw is _EOF:
        await call.abort(grpc.StatusCode.INTERNAL, "the call ended before its request")
    parse = handler.request_deserializer
    request = parse(raw) if parse is not None else raw
    inner = handler.unary_stream or handler.unary_unary
    await _answer(inner(request, call), call, handler.unary_unary is not None)


async def _answer(result: Any, call: FrontCall, unary: bool) -> None:
    if inspect.isasyncgen(result):
        async with contextlib.aclosing(result):
            async for response in result:
                await call.write(response)
        return
    response = (await result) if inspect.isawaitable(result) else result
    if unary and response is not None:
        await call.write(response)
