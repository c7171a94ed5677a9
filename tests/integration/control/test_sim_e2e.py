"""End to end through the control plane to the C++ worker (engine: sim), which the
control plane starts and stops itself."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from switchyard.v1 import admin_pb2, admin_pb2_grpc, common_pb2, generation_pb2, generation_pb2_grpc
from switchyard.worker.v1 import worker_pb2, worker_pb2_grpc

from control.text.tokenizer import Tokenizer
from tests.procs import Proc, serving_control

FR = common_pb2.FinishReason


@pytest.fixture(scope="module", params=["python", "native"])
def sim_control(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Proc]:
    """The control plane on each api.front (grpc.aio, and the native grpc++ front)."""
    models = (
        "  - name: sim-tiny\n"
        "    engine: sim\n"
        "    model: builtin:tiny\n"
        "    engine_args: {max_context: 2048, decode_step_us: 1000, max_batch: 512,\n"
        "                  kv_blocks: 100000}\n"
    )
    tmp = tmp_path_factory.mktemp(f"sim-control-{request.param}")
    settings = f"api: {{front: {request.param}}}\n"
    with serving_control(tmp, models, "sim-tiny", settings=settings, timeout=120) as proc:
        yield proc


def request(max_tokens: int, text: str = "Hello") -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        model="sim-tiny",
        text=text,
        stopping=generation_pb2.StoppingParams(max_tokens=max_tokens, ignore_eos=True),
    )


def test_generate_through_the_control_plane(sim_control: Proc, tiny_model_dir: Path) -> None:
    with grpc.insecure_channel(sim_control.address) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        chunks = []
        final = None
        for msg in stub.Generate(request(30), timeout=30):
            if msg.HasField("chunk"):
                chunks.append(msg.chunk)
            else:
                final = msg.final
        assert final is not None
        assert final.finish_reason == FR.FINISH_REASON_LENGTH
        assert final.engine.startswith("sim ")
        ids = [t for c in chunks for t in c.token_ids]
        assert len(ids) == 30 == final.usage.completion_tokens
        tok = Tokenizer(str(tiny_model_dir))
        assert "".join(c.text for c in chunks) == tok.decode(ids, skip_special_tokens=True)
        done = stub.Complete(request(30), timeout=30)
        assert list(done.token_ids) == ids  # the simulator is deterministic
        models = stub.ListModels(generation_pb2.ListModelsRequest(), timeout=5).models
        assert [(m.name, m.healthy_workers) for m in models] == [("sim-tiny", 1)]


async def _one_stream(
    stub: generation_pb2_grpc.GenerationStub, rng: random.Random, outcome: dict[str, int]
) -> str | None:
    max_tokens = rng.randint(10, 200)
    cancel_after = rng.randint(1, max_tokens) if rng.random() < 0.3 else None
    call = stub.Generate(request(max_tokens, f"stream {rng.random()}"), timeout=60)
    tokens = 0
    worker = None
    try:
        async for msg in call:
            if msg.HasField("chunk"):
                tokens += len(msg.chunk.token_ids)
                if cancel_after is not None and tokens >= cancel_after:
                    call.cancel()
                    break
            else:
                assert msg.final.finish_reason == FR.FINISH_REASON_LENGTH
                assert msg.final.usage.completion_tokens == tokens == max_tokens
                worker = msg.final.worker
                outcome["final"] += 1
                return worker
    except asyncio.CancelledError:
        pass
    if cancel_after is not None:
        assert call.cancelled() or (await call.code()) == grpc.StatusCode.CANCELLED
        outcome["cancelled"] += 1
        return None
    raise AssertionError("the stream ended without a final message or a status")


async def test_200_concurrent_streams_with_random_cancellations(sim_control: Proc) -> None:
    rng = random.Random(2026)
    outcome = {"final": 0, "cancelled": 0}
    async with grpc.aio.insecure_channel(sim_control.address) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        results = await asyncio.wait_for(
            asyncio.gather(*(_one_stream(stub, rng, outcome) for _ in range(200))), timeout=120
        )
    assert outcome["final"] + outcome["cancelled"] == 200
    assert outcome["cancelled"] > 20
    workers = {w for w in results if w}
    assert len(workers) == 1
    # The control plane's own books balance: nothing left in flight on the worker.
    async with grpc.aio.insecure_channel(sim_control.address) as ch:
        admin = admin_pb2_grpc.AdminStub(ch)
        for _ in range(50):
            listed = (await admin.ListWorkers(admin_pb2.ListWorkersRequest(), timeout=5)).workers
            if all(w.in_flight == 0 for w in listed):
                break
            await asyncio.sleep(0.02)
        assert [w.in_flight for w in listed] == [0]
    # The worker's running count returns to 0.
    async with grpc.aio.insecure_channel(workers.pop()) as wch:
        wstub = worker_pb2_grpc.WorkerStub(wch)
        for _ in range(100):
            call = wstub.StreamLoad(worker_pb2.StreamLoadRequest(interval_ms=10), timeout=5)
            report = await call.read()
            call.cancel()
            if report.running == 0 and report.waiting == 0:
                break
            await asyncio.sleep(0.02)
        assert report.running == 0 and report.waiting == 0
