"""The canary: a worker that stops answering it has its streams moved elsewhere, however
its circuit came to be open; a worker whose canary only waits behind its load stays."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from control.workers import health
from control.workers.client import WorkerClient
from control.workers.health import HealthPolicy
from control.workers.state import Load, WorkerInfo


def serving_client() -> tuple[WorkerClient, asyncio.Event]:
    """A serving worker's client (canaries every 10 ms, two failures open its circuit)
    with one call on it, and the event its ejection sets."""
    client = WorkerClient("127.0.0.1:1", HealthPolicy(canary_interval_s=0.01, failure_threshold=2))
    client.serving = True
    client.info = WorkerInfo("sim", "t", "m", 2048, 512, (1,), 16, True)
    ejected = asyncio.Event()

    class Call:
        def eject(self) -> None:
            ejected.set()

    client.calls.add(Call())  # type: ignore[arg-type]
    return client, ejected


@contextlib.asynccontextmanager
async def canaries(client: WorkerClient) -> AsyncIterator[None]:
    """The client's canary loop, running until the block ends."""
    canary = asyncio.create_task(health.canary(client, client.stub, client.health_policy))
    try:
        yield
    finally:
        canary.cancel()
        await asyncio.gather(canary, return_exceptions=True)
        await client.channel.close(None)


async def test_a_failing_canary_ejects_calls_when_requests_opened_the_circuit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    client, ejected = serving_client()
    for _ in range(2):  # two requests failed: the circuit is open before any canary
        client.breaker.record_failure()
    assert not client.breaker.allows_traffic()

    async def no_answer(worker: Any, stub: Any, timeout: float) -> str:
        return "failed"

    monkeypatch.setattr(health, "probe", no_answer)
    async with canaries(client), asyncio.timeout(5):
        await ejected.wait()


@pytest.mark.parametrize(
    ("tokens_per_s", "ejected_expected"),
    [(0.0, True), (850.0, False)],
    ids=["hung-engine-live-server", "busy-engine"],
)
async def test_a_timed_out_canary_counts_unless_the_engine_is_generating(
    monkeypatch: pytest.MonkeyPatch, tokens_per_s: float, ejected_expected: bool
) -> None:
    """Load reports keep coming (the worker's server lives); only the engine's token rate
    tells a hung engine from a busy one."""
    client, ejected = serving_client()

    async def times_out(worker: Any, stub: Any, timeout: float) -> str:
        await asyncio.sleep(0.02)  # a load report arrives meanwhile
        worker.load = Load(running=2, waiting=6, updated=time.monotonic(),
                                  generation_tokens_per_s=tokens_per_s)  # fmt: skip
        return "queued"

    monkeypatch.setattr(health, "probe", times_out)
    async with canaries(client):
        if ejected_expected:
            async with asyncio.timeout(5):
                await ejected.wait()
        else:
            await asyncio.sleep(0.5)  # about 15 canaries, every one timed out
            assert not ejected.is_set() and client.breaker.allows_traffic()
