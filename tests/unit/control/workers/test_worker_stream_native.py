"""GenerateStream's native direct path against a scripted worker stream and a scripted
front: an attempt handed over has its chunks made by the front, comes back with the
tokens the front wrote before the first event the front leaves to Python (a chunk it
cannot make, the Final), and when it ends on this side (a cancel, a broken stream), so
that the request's output is whole before anyone reads on."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from switchyard.front.v1 import front_pb2
from switchyard.worker.v1 import worker_pb2

from control.workers.call import FailureKind, WorkerCallFailed
from control.workers.stream import Handover, StreamCall, StreamSession
from tests.unit.control.workers.test_worker_stream import (
    ScriptedCall,
    Stub,
    chunk,
    drain,
    final,
    request,
)

DECLINED = 0  # a token id the scripted front will not make a chunk of


class RawCall(ScriptedCall):
    """The scripted worker stream, read as bytes (as the session reads it for the native
    front)."""

    def send(self, *events: worker_pb2.StreamEvent) -> None:
        raw = worker_pb2.StreamResponse(events=events).SerializeToString()
        self._inbox.put_nowait(raw)  # type: ignore[arg-type]


class ScriptedFront:
    """The front's direct path as runtime_cpp/src/front/direct.h behaves: chunks of
    attempts handed over are written here, unless a token is DECLINED; anything else of
    such an attempt hands it back first."""

    def __init__(self) -> None:
        self.attempts: dict[tuple[int, int], list[int]] = {}
        self.written: list[tuple[int, list[int]]] = []  # (public call, token ids)
        self.calls: dict[tuple[int, int], int] = {}

    def direct_start(
        self, stream: int, attempt: int, call: int, vocab: int, pending: bytes, last_at: float
    ) -> bool:
        self.attempts[stream, attempt] = []
        self.calls[stream, attempt] = call
        return True

    def _back(self, key: tuple[int, int]) -> front_pb2.Handback:
        ids = self.attempts.pop(key)
        return front_pb2.Handback(attempt=key[1], token_ids=ids, last_token_at=123.0)

    def direct_stop(self, stream: int, attempt: int) -> bytes:
        if (stream, attempt) not in self.attempts:
            return b""
        return self._back((stream, attempt)).SerializeToString()

    def feed(self, stream: int, raw: bytes) -> bytes:
        message = worker_pb2.StreamResponse.FromString(raw)
        rest = worker_pb2.StreamResponse()
        result = front_pb2.FeedResult()
        for event in message.events:
            key = (stream, event.attempt_id)
            if key not in self.attempts:
                rest.events.append(event)
                continue
            ids = list(event.chunk.token_ids)
            if event.HasField("chunk") and DECLINED not in ids:
                self.attempts[key].extend(ids)
                self.written.append((self.calls[key], ids))
                result.tokens += len(ids)
                result.itl.append(0.01)
                continue
            result.handbacks.append(self._back(key))
            rest.events.append(event)
        result.rest = rest.SerializeToString()
        return result.SerializeToString()


class Direct:
    """An attempt's direct handler: takes chunks itself, hands the attempt to the front,
    and keeps what the front hands back."""

    def __init__(self, front: ScriptedFront) -> None:
        self.front = front
        self.taken: list[list[int]] = []
        self.adopted: list[list[int]] = []
        self.log: list[tuple[str, list[int]]] = []  # both, in the order they happened
        self.itl: list[float] = []
        self.counted: list[int] = []

    def __call__(self, c: worker_pb2.Chunk) -> bool:
        self.taken.append(list(c.token_ids))
        self.log.append(("taken", list(c.token_ids)))
        return True

    def handover(self) -> Handover | None:
        return Handover(self.front, 77, 0, b"", 1.0, self.itl.append, self.counted.append)

    def adopt(self, token_ids: Sequence[int], last_token_at: float) -> None:
        assert last_token_at == 123.0
        self.adopted.append(list(token_ids))
        self.log.append(("adopted", list(token_ids)))


def session_on(wire: RawCall) -> StreamSession:
    return StreamSession(Stub(wire), "w:1", raw_stream=lambda: wire)


async def one_attempt() -> tuple[RawCall, ScriptedFront, StreamCall, int, Direct]:
    """A session read as bytes with one attempt started, its direct handler set."""
    wire, front = RawCall(), ScriptedFront()
    call = session_on(wire).open(request(), None)
    (start,) = (await wire.next_write()).start
    direct = Direct(front)
    call.direct = direct
    return wire, front, call, start.attempt_id, direct


async def test_the_front_writes_the_chunks_and_hands_back_before_the_final() -> None:
    wire, front, call, a, direct = await one_attempt()
    wire.send(chunk(a, 5))  # Python's chunk: then the attempt goes to the front
    await wire.delivered_at_least(1)
    assert direct.taken == [[5]] and [k[1] for k in front.attempts] == [a]
    wire.send(chunk(a, 6, 7), chunk(a, 8))
    wire.send(chunk(a, 9), final(a))
    events = await drain(call)
    assert front.written == [(77, [6, 7]), (77, [8]), (77, [9])]
    assert direct.log == [("taken", [5]), ("adopted", [6, 7, 8, 9])]
    assert call._session._handed == 0 and not front.attempts
    assert [e.HasField("final") for e in events] == [True] and len(direct.itl) == 3
    assert sum(direct.counted) == 4  # counted as the front writes them


async def test_a_chunk_the_front_declines_comes_back_after_the_tokens_it_wrote() -> None:
    wire, front, call, a, direct = await one_attempt()
    wire.send(chunk(a, 5))
    wire.send(chunk(a, 6), chunk(a, DECLINED, 7), chunk(a, 8))
    wire.send(chunk(a, 9))
    wire.send(final(a))
    await drain(call)
    # 6 by the front; the declined chunk by Python after it got 6 back, and the rest of
    # that message; handed over again, 9 by the front, back before the final.
    assert front.written == [(77, [6]), (77, [9])]
    # Each time, the tokens come back before Python takes the next chunk.
    assert direct.log == [
        ("taken", [5]),
        ("adopted", [6]),
        ("taken", [DECLINED, 7]),
        ("taken", [8]),
        ("adopted", [9]),
    ]
    assert call._session._handed == 0 and not front.attempts


async def test_a_cancel_takes_the_attempt_back_with_what_the_front_wrote() -> None:
    wire, front, call, a, direct = await one_attempt()
    wire.send(chunk(a, 5))
    wire.send(chunk(a, 6))
    await wire.delivered_at_least(2)
    assert call.cancel()
    assert direct.adopted == [[6]] and not front.attempts and call._session._handed == 0
    assert list((await wire.next_write()).cancel) == [a]


async def test_a_broken_stream_gives_the_tokens_back_before_the_failure() -> None:
    """Failover resumes from the output so far: it must hold what the front wrote."""
    wire, front = RawCall(), ScriptedFront()
    session = session_on(wire)
    call = session.open(request(), None)
    other = session.open(request("other"), None)
    starts = (await wire.next_write()).start
    a, b = starts[0].attempt_id, starts[1].attempt_id
    direct = Direct(front)
    call.direct = direct
    wire.send(chunk(a, 5), chunk(b, 1))
    wire.send(chunk(a, 6), chunk(b, 2))
    await wire.delivered_at_least(2)
    assert front.written == [(77, [6])]
    wire._inbox.put_nowait(None)  # the worker's stream ends
    with pytest.raises(WorkerCallFailed) as failed:
        await drain(call)
    assert failed.value.kind is FailureKind.LOST
    assert direct.adopted == [[6]] and not front.attempts and session._handed == 0
    with pytest.raises(WorkerCallFailed):  # the other, on Python's path, fails the same
        await drain(other)


async def test_messages_are_parsed_here_when_nothing_is_handed_over() -> None:
    wire, front = RawCall(), ScriptedFront()
    session = session_on(wire)
    call = session.open(request(), None)
    (start,) = (await wire.next_write()).start
    a = start.attempt_id
    wire.send(chunk(a, 5), chunk(a, 6), final(a))
    events = await drain(call)
    assert [list(e.chunk.token_ids) for e in events[:-1]] == [[5, 6]]  # merged: behind
    assert not front.written


async def test_a_deadline_takes_the_attempt_back_before_it_fails() -> None:
    wire, front = RawCall(), ScriptedFront()
    session = session_on(wire)
    call = session.open(request(), 0.5)
    (start,) = (await wire.next_write()).start
    a = start.attempt_id
    direct = Direct(front)
    call.direct = direct
    wire.send(chunk(a, 5))
    wire.send(chunk(a, 6))
    await wire.delivered_at_least(2)
    with pytest.raises(WorkerCallFailed) as failed:  # the worker says nothing more
        await drain(call)
    assert failed.value.kind is FailureKind.DEADLINE
    assert direct.log == [("taken", [5]), ("adopted", [6])]
    assert not front.attempts and session._handed == 0
    assert list((await wire.next_write()).cancel) == [a]
