"""The control plane's side of GenerateStream against a scripted worker stream: attempts
keyed by ids of its own, a writer that fails, a reader that falls behind, and shutdown
that does not swallow its caller's cancellation."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from switchyard.worker.v1 import worker_pb2

from control.workers.call import FailureKind, WorkerCallFailed
from control.workers.client import WorkerClient
from control.workers.stream import StreamSession

DEADLINE_S = 5.0


class ScriptedCall:
    """A bidi call whose server side the test plays: `send()` puts a StreamResponse on
    the wire, `written` is what the session wrote."""

    def __init__(self, fail_writes: bool = False) -> None:
        self.written: list[worker_pb2.StreamRequest] = []
        self.fail_writes = fail_writes
        self.cancelled = False
        self.delivered = 0  # responses the session has read
        self._inbox: asyncio.Queue[worker_pb2.StreamResponse | None] = asyncio.Queue()
        self._wrote = asyncio.Event()
        self._read = asyncio.Event()

    async def write(self, message: worker_pb2.StreamRequest) -> None:
        if self.fail_writes:
            raise RuntimeError("the transport refused the write")
        self.written.append(message)
        self._wrote.set()

    def send(self, *events: worker_pb2.StreamEvent) -> None:
        self._inbox.put_nowait(worker_pb2.StreamResponse(events=events))

    def __aiter__(self) -> AsyncIterator[worker_pb2.StreamResponse]:
        return self._responses()

    async def _responses(self) -> AsyncIterator[worker_pb2.StreamResponse]:
        while True:
            message = await self._inbox.get()
            if message is None:
                return
            self.delivered += 1
            self._read.set()
            yield message

    def cancel(self) -> bool:
        self.cancelled = True
        return True

    async def delivered_at_least(self, n: int) -> None:
        async with asyncio.timeout(DEADLINE_S):
            while self.delivered < n:
                self._read.clear()
                await self._read.wait()

    async def next_write(self) -> worker_pb2.StreamRequest:
        async with asyncio.timeout(DEADLINE_S):
            while not self.written:
                self._wrote.clear()
                await self._wrote.wait()
        return self.written.pop(0)


class Stub:
    def __init__(self, call: ScriptedCall) -> None:
        self.call = call

    def GenerateStream(self) -> ScriptedCall:
        return self.call


def chunk(attempt: int, *ids: int) -> worker_pb2.StreamEvent:
    return worker_pb2.StreamEvent(attempt_id=attempt, chunk=worker_pb2.Chunk(token_ids=ids))


def final(attempt: int) -> worker_pb2.StreamEvent:
    return worker_pb2.StreamEvent(attempt_id=attempt, final=worker_pb2.Final())


def request(request_id: str = "r") -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=[1], max_tokens=4)


async def drain(call: Any) -> list[Any]:
    async with asyncio.timeout(DEADLINE_S):
        return [event async for event in call]


async def test_a_retry_with_the_same_request_id_never_sees_the_old_attempts_events() -> None:
    wire = ScriptedCall()
    session = StreamSession(Stub(wire), "w:1")
    first = session.open(request("same"), None)
    sent = await wire.next_write()
    first.cancel()
    second = session.open(request("same"), None)
    cancel_then_start = await wire.next_write()
    (old_start,) = sent.start
    (new_start,) = cancel_then_start.start
    assert list(cancel_then_start.cancel) == [old_start.attempt_id]
    assert new_start.attempt_id != old_start.attempt_id
    # The worker had queued tokens of the old attempt: they go nowhere.
    wire.send(
        chunk(old_start.attempt_id, 7, 7),
        chunk(new_start.attempt_id, 1),
        final(old_start.attempt_id),
    )
    wire.send(final(new_start.attempt_id))
    events = await drain(second)
    assert [list(e.chunk.token_ids) for e in events if e.HasField("chunk")] == [[1]]


async def test_a_cancel_before_the_start_is_sent_takes_the_start_back() -> None:
    wire = ScriptedCall()
    session = StreamSession(Stub(wire), "w:1")
    kept = session.open(request("kept"), None)
    dropped = session.open(request("dropped"), None)
    dropped.cancel()  # before the writer ran: neither its start nor a cancel go out
    message = await wire.next_write()
    assert [s.request_id for s in message.start] == ["kept"] and not message.cancel
    wire.send(final(kept.attempt_id))
    await drain(kept)


async def test_a_failed_write_fails_every_open_attempt_at_once() -> None:
    wire = ScriptedCall(fail_writes=True)
    session = StreamSession(Stub(wire), "w:1")
    call = session.open(request(), None)  # no deadline: before the fix this waited forever
    with pytest.raises(WorkerCallFailed) as failed:
        await drain(call)
    assert failed.value.kind is FailureKind.LOST and "write" in failed.value.message
    assert wire.cancelled and session.open_calls == 0


async def test_a_reader_that_falls_behind_holds_the_stream_until_it_catches_up() -> None:
    wire = ScriptedCall()
    session = StreamSession(Stub(wire), "w:1", max_buffered_tokens=8, slow_reader_grace_s=60)
    slow = session.open(request("slow"), None)
    await wire.next_write()
    for _ in range(50):
        wire.send(chunk(slow.attempt_id, 1, 2, 3, 4))
    wire.send(final(slow.attempt_id))
    # All 51 messages wait in the transport. The session stops reading once `slow` has
    # more than 8 tokens unread (after the third): the rest stays with the worker.
    await wire.delivered_at_least(3)
    assert wire.delivered == 3
    # Reading lets the stream go on, and every token arrives, in order.
    tokens: list[int] = []
    async with asyncio.timeout(DEADLINE_S):
        async for event in slow:
            tokens += event.chunk.token_ids
    assert tokens == [1, 2, 3, 4] * 50 and wire.delivered == 51


async def test_a_reader_that_stays_behind_loses_its_request_and_the_stream_reads_on() -> None:
    wire = ScriptedCall()
    session = StreamSession(Stub(wire), "w:1", max_buffered_tokens=8, slow_reader_grace_s=0.3)
    slow = session.open(request("slow"), None)
    other = session.open(request("other"), None)
    await wire.next_write()
    for _ in range(50):
        wire.send(chunk(slow.attempt_id, 1, 2, 3, 4))
    wire.send(chunk(other.attempt_id, 5), final(other.attempt_id))
    cancel = await wire.next_write()  # after the grace: the worker is told to stop
    assert list(cancel.cancel) == [slow.attempt_id]
    with pytest.raises(WorkerCallFailed) as failed:
        await drain(slow)
    assert failed.value.kind is FailureKind.SLOW_READER
    events = await drain(other)
    assert events[-1].HasField("final")


async def test_closing_a_worker_client_does_not_swallow_its_callers_cancellation() -> None:
    client = WorkerClient("127.0.0.1:1")
    client.start_watching()
    await asyncio.sleep(0)
    closing = asyncio.create_task(client.close())
    await asyncio.sleep(0)  # close() is now waiting for its watchers
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    await client.channel.close(None)


async def test_a_workers_field_violations_reach_the_client_by_their_public_names() -> None:
    from switchyard.v1 import generation_pb2

    from control.errors import InvalidArgument
    from control.request.failover import client_error as to_client
    from control.text.params import parse_request

    wire = ScriptedCall()
    session = StreamSession(Stub(wire), "w:1")
    call = session.open(request(), None)
    await wire.next_write()
    error = worker_pb2.StreamError(
        code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
        message="max_tokens: too many",
        field_violations=[worker_pb2.FieldViolation(field="max_tokens", description="too many")],
    )
    wire.send(worker_pb2.StreamEvent(attempt_id=call.attempt_id, error=error))
    with pytest.raises(WorkerCallFailed) as failed:
        await drain(call)
    assert failed.value.kind is FailureKind.REJECTED
    params = parse_request(generation_pb2.GenerateRequest(model="m", text="hi"))
    client_error = to_client(failed.value, params)
    assert isinstance(client_error, InvalidArgument)
    assert [v.field for v in client_error.violations] == ["stopping.max_tokens"]


async def test_a_slow_reader_never_holds_back_the_rest_of_a_message() -> None:
    wire = ScriptedCall()
    session = StreamSession(Stub(wire), "w:1", max_buffered_tokens=8, slow_reader_grace_s=60)
    slow = session.open(request("slow"), None)
    other = session.open(request("other"), None)
    await wire.next_write()
    # One message: `slow` goes over its limit first, `other` finishes after it.
    wire.send(
        chunk(slow.attempt_id, *range(12)), chunk(other.attempt_id, 5), final(other.attempt_id)
    )
    events = await drain(other)  # while `slow` is still unread
    assert [list(e.chunk.token_ids) for e in events[:-1]] == [[5]]
    slow.cancel()


async def test_a_message_the_reader_cannot_take_breaks_the_stream_at_once() -> None:
    wire = ScriptedCall()
    session = StreamSession(Stub(wire), "w:1")
    call = session.open(request(), None)  # no deadline: it must not wait forever
    await wire.next_write()
    wire._inbox.put_nowait(object())  # type: ignore[arg-type]  # has no .events
    with pytest.raises(WorkerCallFailed) as failed:
        await drain(call)
    assert failed.value.kind is FailureKind.LOST and wire.cancelled


async def test_a_deadline_beyond_the_wire_limit_means_no_deadline() -> None:
    wire = ScriptedCall()
    session = StreamSession(Stub(wire), "w:1")
    req = request()
    call = session.open(req, 1e10)  # about 300 years
    assert req.timeout_ms == 0
    (start,) = (await wire.next_write()).start
    wire.send(final(start.attempt_id))
    await drain(call)


async def test_direct_chunks_go_where_they_arrive_and_a_declined_one_queues_in_order() -> None:
    wire = ScriptedCall()
    session = StreamSession(Stub(wire), "w:1")
    call = session.open(request(), None)
    (start,) = (await wire.next_write()).start
    taken: list[list[int]] = []
    accept = True

    def direct(c: worker_pb2.Chunk) -> bool:
        if accept:
            taken.append(list(c.token_ids))
        return accept

    call.direct = direct
    wire.send(chunk(start.attempt_id, 1), chunk(start.attempt_id, 2))
    await wire.delivered_at_least(1)
    assert taken == [[1], [2]] and call.direct is direct  # nothing queued
    accept = False  # the client's stream is full: declined, queued, and direct is off
    wire.send(chunk(start.attempt_id, 3), chunk(start.attempt_id, 4), final(start.attempt_id))
    events = await drain(call)
    assert [list(e.chunk.token_ids) for e in events if e.HasField("chunk")] == [[3, 4]]
    assert events[-1].HasField("final") and call.direct is None and taken == [[1], [2]]


async def test_a_direct_chunk_that_raises_fails_its_attempt_and_cancels_it_on_the_worker() -> None:
    wire = ScriptedCall()
    session = StreamSession(Stub(wire), "w:1")
    call = session.open(request(), None)
    other = session.open(request("other"), None)
    starts = (await wire.next_write()).start
    mine, theirs = starts[0].attempt_id, starts[1].attempt_id

    def direct(c: worker_pb2.Chunk) -> bool:
        raise ValueError("a bug in making the public chunk")

    call.direct = direct
    wire.send(chunk(mine, 1), chunk(theirs, 5))
    with pytest.raises(ValueError, match="a bug"):
        await drain(call)
    assert list((await wire.next_write()).cancel) == [mine]  # the worker stops generating
    wire.send(final(theirs))  # the stream and the other attempt go on
    assert [e.HasField("final") for e in await drain(other)] == [False, True]
