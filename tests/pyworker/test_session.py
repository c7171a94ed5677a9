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
