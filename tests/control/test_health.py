"""The canary: a worker that stops answering it has its streams moved elsewhere, however
its circuit came to be open."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from control.workers import health
from control.workers.client import HealthPolicy, WorkerClient, WorkerInfo


async def test_a_failing_canary_ejects_calls_when_requests_opened_the_circuit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    client = WorkerClient("127.0.0.1:1", HealthPolicy(canary_interval_s=0.01, failure_threshold=2))
    client.serving = True
    client.info = WorkerInfo("sim", "t", "m", 2048, 512, (1,), 16, True)
    for _ in range(2):  # two requests failed: the circuit is open before any canary
        client.breaker.record_failure()
    assert not client.breaker.allows_traffic()
    ejected = asyncio.Event()

    class Call:
        def eject(self) -> None:
            ejected.set()

    client.calls.add(Call())  # type: ignore[arg-type]

    async def no_answer(worker: Any, timeout: float) -> bool:
        return False

    monkeypatch.setattr(health, "probe", no_answer)
    canary = asyncio.create_task(health.canary(client))
    try:
        async with asyncio.timeout(5):
            await ejected.wait()
    finally:
        canary.cancel()
        await asyncio.gather(canary, return_exceptions=True)
        await client.channel.close(None)
