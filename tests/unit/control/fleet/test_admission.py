"""Admission: concurrency and queue limits, priority order, cancellation while queued."""

from __future__ import annotations

import asyncio

import pytest

from control.api.status import to_rpc_status
from control.errors import Overloaded
from control.fleet.admission import Admission


async def test_limits_and_priority_order() -> None:
    adm = Admission("m", max_concurrency=2, max_queue=3)
    await adm.acquire(0, None)
    await adm.acquire(0, None)
    order: list[str] = []

    async def wait(name: str, prio: int) -> None:
        await adm.acquire(prio, None)
        order.append(name)

    tasks = [
        asyncio.create_task(wait("low", 0)),
        asyncio.create_task(wait("high", 5)),
        asyncio.create_task(wait("mid", 1)),
    ]
    await asyncio.sleep(0)
    assert adm.queued == 3
    with pytest.raises(Overloaded) as info:
        await adm.acquire(9, None)
    code, _, trailers = to_rpc_status(info.value)
    assert code.name == "RESOURCE_EXHAUSTED" and trailers
    for _ in range(3):
        adm.release()
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    assert order == ["high", "mid", "low"]
    assert adm.running == 2 and adm.queued == 0
    adm.release()
    adm.release()
    assert adm.running == 0


async def test_timeout_and_cancel_leave_the_queue() -> None:
    adm = Admission("m", max_concurrency=1, max_queue=5)
    await adm.acquire(0, None)
    with pytest.raises(TimeoutError):
        await adm.acquire(0, 0.01)
    assert adm.queued == 0
    task = asyncio.create_task(adm.acquire(0, None))
    await asyncio.sleep(0)
    assert adm.queued == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert adm.queued == 0
    adm.release()
    assert adm.running == 0
