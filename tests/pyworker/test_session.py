"""GenerateStream's pending message on the vLLM worker: cancelling one attempt drops what
is queued for it and nothing of anyone else's."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from switchyard.worker.v1 import worker_pb2

from pyworker.session import Session


async def test_cancelling_one_attempt_keeps_every_later_token_of_the_others() -> None:
    async def never_written(message: Any) -> None:
        raise AssertionError("nothing is written in this test")

    session = Session(cast(Any, None), never_written)
    idle = [asyncio.create_task(asyncio.sleep(3600)) for _ in range(3)]
    session._tasks = {1: idle[0], 2: idle[1], 3: idle[2]}
    session._chunk(1, worker_pb2.Chunk(token_ids=[10]))
    session._chunk(2, worker_pb2.Chunk(token_ids=[20]))
    session._chunk(3, worker_pb2.Chunk(token_ids=[30]))
    session._cancel(1)
    session._chunk(2, worker_pb2.Chunk(token_ids=[21]))
    session._chunk(3, worker_pb2.Chunk(token_ids=[31]))
    pending = {e.attempt_id: list(e.chunk.token_ids) for e in session._pending.events}
    assert pending == {2: [20, 21], 3: [30, 31]}
    for task in idle:
        task.cancel()
    await asyncio.gather(*idle, return_exceptions=True)


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
    idle = asyncio.create_task(asyncio.sleep(3600))
    session._tasks = {7: idle}
    session._final(7, worker_pb2.Final())
    del session._tasks[7]
    session._closing = True
    session._ready.set()
    async with asyncio.timeout(5):
        await writer
    assert [e.attempt_id for m in written for e in m.events] == [7]
    idle.cancel()
    await asyncio.gather(idle, return_exceptions=True)
