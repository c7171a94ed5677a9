"""The canary: a worker that stops answering it has its streams moved elsewhere, however
its circuit came to be open; a worker whose canary only waits behind its load stays."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from switchyard.v1 import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc

from control.fleet.local_workers import free_port
from control.workers import health
from control.workers.client import WorkerClient
from control.workers.health import HealthPolicy
from control.workers.state import Load, WorkerInfo
from tests.procs import serving_control


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


def test_a_saturated_worker_is_not_ejected_for_canaries_queued_behind_its_load(
    tmp_path: Path,
) -> None:
    """One simulated worker, two requests at a time, eight sent, 2 s each pair: the canary
    waits behind six and times out again and again, yet the engine is generating, so the
    worker stays in, and every stream completes (before, two such canaries between two
    finished requests ejected it, and its streams had nowhere to go)."""
    models = (
        "  - name: sim\n    engine: sim\n    model: builtin:tiny\n"
        "    engine_args: {max_batch: 2, decode_step_us: 20000}\n"
        "    health: {canary_interval_s: 0.2, canary_timeout_s: 0.5, failure_threshold: 2}\n"
    )
    with serving_control(tmp_path, free_port(), models, "sim") as proc:
        with grpc.insecure_channel(proc.address) as ch:
            gen = generation_pb2_grpc.GenerationStub(ch)
            req = generation_pb2.GenerateRequest(
                model="sim",
                text="Hello",
                stopping=generation_pb2.StoppingParams(max_tokens=100, ignore_eos=True),
            )
            futures = [gen.Complete.future(req, timeout=60) for _ in range(8)]
            done = [f.result() for f in futures]
            (w,) = (
                admin_pb2_grpc.AdminStub(ch)
                .ListWorkers(admin_pb2.ListWorkersRequest(), timeout=10)
                .workers
            )
        log = proc.log_path.read_text()
    assert [d.final.usage.completion_tokens for d in done] == [100] * 8
    assert w.routable and w.circuit == "closed", w
    assert "worker ejected" not in log and "circuit open" not in log
