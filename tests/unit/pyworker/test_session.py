"""GenerateStream's pending message on the vLLM worker: cancelling one attempt drops what
is queued for it and nothing of anyone else's."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from switchyard.worker.v1 import worker_pb2

from pyworker.session import Session


class _Request:
    """Stands in for a StreamedRequest: what the session asks of one."""

    def __init__(self) -> None:
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True
        self.done.set_result(None)


def _open(session: Session, *attempt_ids: int) -> dict[int, _Request]:
    requests = {a: _Request() for a in attempt_ids}
    session._requests = cast(Any, dict(requests))
    session._live = set(attempt_ids)
    return requests


async def test_cancelling_one_attempt_keeps_every_later_token_of_the_others() -> None:
    async def never_written(message: Any) -> None:
        raise AssertionError("nothing is written in this test")

    session = Session(cast(Any, None), never_written)
    requests = _open(session, 1, 2, 3)
    session._chunk(1, [10], None)
    session._chunk(2, [20], None)
    session._chunk(3, [30], None)
    session._cancel(1)
    session._chunk(1, [11], None)  # the engine's next output for it, already on its way
    session._chunk(2, [21], None)
    session._chunk(3, [31], None)
    pending = {e.attempt_id: list(e.chunk.token_ids) for e in session._pending.events}
    assert pending == {2: [20, 21], 3: [30, 31]}
    assert [a for a, r in requests.items() if r.cancelled] == [1]


async def test_the_last_events_go_out_and_the_stream_ends_when_the_caller_closed() -> None:
    """The final of the last attempt is queued, the attempt ends and the caller has closed
    its side, all before the writer runs: the writer sends it and ends (it used to send it
    and then wait forever, and the call hung until its deadline)."""
    written: list[Any] = []

    async def write(message: Any) -> None:
        written.append(message)

    session = Session(cast(Any, None), write)
    writer = asyncio.create_task(session._write_loop())
    await asyncio.sleep(0)  # the writer waits for news
    _open(session, 7)
    session._final(7, worker_pb2.Final())
    session._requests.clear()
    session._closing = True
    session._ready.set()
    async with asyncio.timeout(5):
        await writer
    assert [e.attempt_id for m in written for e in m.events] == [7]
