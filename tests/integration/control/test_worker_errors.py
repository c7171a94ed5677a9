"""What a client hears when a worker fails its request, through the real control plane
(in-process) in front of a scripted worker: a gRPC server that speaks the worker API and
answers every generation with the status the test chose, on both worker paths
(`GenerateStream` and one `Generate` call per request)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
import structlog
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio  # type: ignore[attr-defined]
from grpc_status import rpc_status
from switchyard.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from switchyard.worker.v1 import worker_pb2, worker_pb2_grpc

from control.config import parse_config
from control.fleet.local_workers import free_port
from control.server import ControlPlane
from switchyard_common.rpc_status import FieldViolation, status_trailers

RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT
INTERNAL = grpc.StatusCode.INTERNAL

# What the scripted worker answers, by mode: (code, message, violations, retry after)
ANSWERS: dict[str, tuple[grpc.StatusCode, str, list[FieldViolation], float | None]] = {
    "full": (RESOURCE_EXHAUSTED, "engine full", [], 0.25),
    "invalid": (
        INVALID_ARGUMENT,
        "max_tokens: too many",
        [FieldViolation("max_tokens", "too many")],
        None,
    ),
    "broken": (INTERNAL, "engine error: CUDA went away", [], None),
}


class ScriptedWorker(worker_pb2_grpc.WorkerServicer):  # type: ignore[misc]
    def __init__(self) -> None:
        self.mode = "full"
        self.generations = 0

    def _answer(self) -> tuple[grpc.StatusCode, str, list[FieldViolation], float | None]:
        self.generations += 1
        return ANSWERS[self.mode]

    async def Generate(self, request: Any, context: Any) -> None:
        if request.max_tokens == 1 and request.request_id.startswith("canary-"):
            await context.write(worker_pb2.GenerateResponse(final=worker_pb2.Final()))
            return
        if self.mode == "hang":  # an engine that never answers
            await asyncio.Event().wait()
        if self.mode == "eos-then-die":  # the end of the answer, then the worker is gone
            await context.write(
                worker_pb2.GenerateResponse(chunk=worker_pb2.Chunk(token_ids=[7, 1]))
            )
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker going away")
        code, message, violations, retry = self._answer()
        await context.abort(
            code,
            message,
            trailing_metadata=status_trailers(
                code, message, violations=violations, retry_after_s=retry
            ),
        )

    async def GenerateStream(self, request_iterator: Any, context: Any) -> None:
        async for message in request_iterator:
            for start in message.start:
                if self.mode == "eos-then-die":
                    chunk = worker_pb2.Chunk(token_ids=[7, 1])
                    event = worker_pb2.StreamEvent(attempt_id=start.attempt_id, chunk=chunk)
                    await context.write(worker_pb2.StreamResponse(events=[event]))
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "worker going away")
                code, text, violations, retry = self._answer()
                error = worker_pb2.StreamError(
                    code=code.value[0],
                    message=text,
                    field_violations=[
                        worker_pb2.FieldViolation(field=v.field, description=v.description)
                        for v in violations
                    ],
                    retry_after_ms=int((retry or 0) * 1000),
                )
                event = worker_pb2.StreamEvent(attempt_id=start.attempt_id, error=error)
                await context.write(worker_pb2.StreamResponse(events=[event]))

    async def GetInfo(self, request: Any, context: Any) -> Any:
        return worker_pb2.GetInfoResponse(
            engine="sim", engine_version="scripted", model="scripted", max_context=2048,
            vocab_size=4096, eos_token_ids=[1], kv_block_size=16, generate_stream=True,
        )  # fmt: skip

    async def StreamLoad(self, request: Any, context: Any) -> None:
        while True:
            await context.write(worker_pb2.LoadReport())
            await asyncio.sleep(0.25)


@pytest.fixture(scope="module")
async def scripted() -> AsyncIterator[tuple[ScriptedWorker, str]]:
    server = grpc.aio.server()
    worker = ScriptedWorker()
    worker_pb2_grpc.add_WorkerServicer_to_server(worker, server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await health.set("", health_pb2.HealthCheckResponse.SERVING)
    try:
        yield worker, f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


@pytest.fixture(scope="module", params=[True, False], ids=["stream", "per-call"])
async def plane(
    request: pytest.FixtureRequest, scripted: tuple[ScriptedWorker, str]
) -> AsyncIterator[generation_pb2_grpc.GenerationStub]:
    _, address = scripted
    config = parse_config(
        {
            "listen": f"127.0.0.1:{free_port()}",
            "models": [
                {
                    "name": "m",
                    "engine": "sim",
                    "model": "builtin:tiny",
                    "workers": [address],
                    "worker_stream": request.param,
                    "health": {"canary_interval_s": 3600},
                }
            ],
        }
    )
    cp = ControlPlane(config)
    await cp.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{cp.port}")
    try:
        yield generation_pb2_grpc.GenerationStub(channel)
    finally:
        await channel.close(None)
        await cp.stop(grace=1)


async def call(stub: generation_pb2_grpc.GenerationStub) -> grpc.aio.AioRpcError:
    req = generation_pb2.GenerateRequest(
        model="m", text="Hello", stopping=generation_pb2.StoppingParams(max_tokens=4)
    )
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in stub.Generate(req, timeout=20):
            pass
    return err.value


def details(err: grpc.aio.AioRpcError) -> list[Any]:
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    assert status is not None
    return list(status.details)


async def test_a_full_worker_is_resource_exhausted_with_retry_info(
    plane: generation_pb2_grpc.GenerationStub, scripted: tuple[ScriptedWorker, str]
) -> None:
    scripted[0].mode = "full"
    err = await call(plane)
    assert err.code() == RESOURCE_EXHAUSTED, err.details()
    info = error_details_pb2.RetryInfo()
    assert any(d.Unpack(info) for d in details(err))
    assert info.retry_delay.ToMilliseconds() == 250


async def test_a_workers_field_violation_names_the_public_field(
    plane: generation_pb2_grpc.GenerationStub, scripted: tuple[ScriptedWorker, str]
) -> None:
    scripted[0].mode = "invalid"
    err = await call(plane)
    assert err.code() == INVALID_ARGUMENT, err.details()
    bad = error_details_pb2.BadRequest()
    assert any(d.Unpack(bad) for d in details(err))
    assert [v.field for v in bad.field_violations] == ["stopping.max_tokens"]


async def test_an_engine_fault_is_internal_and_names_the_worker(
    plane: generation_pb2_grpc.GenerationStub, scripted: tuple[ScriptedWorker, str]
) -> None:
    worker, address = scripted
    worker.mode = "broken"
    err = await call(plane)
    assert err.code() == INTERNAL, err.details()
    assert address in (err.details() or "") and "CUDA went away" in (err.details() or "")


async def test_a_bug_in_the_control_plane_is_internal_with_the_request_id(
    plane: generation_pb2_grpc.GenerationStub, monkeypatch: pytest.MonkeyPatch
) -> None:
    from control.request import attempts

    def broken(*args: object) -> int:
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(attempts, "build_worker_request", broken)
    capture = structlog.testing.LogCapture()
    structlog.configure(processors=[structlog.contextvars.merge_contextvars, capture])
    try:
        req = generation_pb2.GenerateRequest(model="m", text="Hello", request_id="req-42")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in plane.Generate(req, timeout=20):
                pass
    finally:
        structlog.reset_defaults()
    assert err.value.code() == INTERNAL
    assert "req-42" in (err.value.details() or "")
    logged = [e for e in capture.entries if e["event"] == "request failed unexpectedly"]
    assert logged and logged[0]["request_id"] == "req-42" and logged[0]["model"] == "m"


async def test_a_channel_closed_under_a_call_is_a_lost_worker_not_a_client_cancel(
    scripted: tuple[ScriptedWorker, str],
) -> None:
    from control.workers.call import FailureKind, WorkerCallFailed
    from control.workers.client import WorkerClient
    from control.workers.health import HealthPolicy

    worker, address = scripted
    worker.mode = "hang"
    client = WorkerClient(address, HealthPolicy(canary_interval_s=3600), worker_stream=False)
    await client.wait_ready(10)
    req = worker_pb2.GenerateRequest(request_id="r", prompt_token_ids=[5], max_tokens=4)
    closing: asyncio.Task[None] | None = None
    with pytest.raises(WorkerCallFailed) as failed:
        async with client.generate(req, None) as events:
            closing = asyncio.create_task(client.close())  # an unload, a worker leaving
            async for _ in events:
                pass
    assert failed.value.kind is FailureKind.LOST  # so the request fails over
    assert closing is not None
    await closing
    assert client.in_flight == 0 and not client.calls


async def test_a_worker_lost_right_after_the_eos_token_ends_the_answer_there(
    plane: generation_pb2_grpc.GenerationStub, scripted: tuple[ScriptedWorker, str]
) -> None:
    scripted[0].mode = "eos-then-die"
    req = generation_pb2.GenerateRequest(
        model="m", text="Hello", stopping=generation_pb2.StoppingParams(max_tokens=16)
    )
    messages = [m async for m in plane.Generate(req, timeout=20)]
    final = messages[-1].final
    assert final.finish_reason == common_pb2.FINISH_REASON_STOP and final.eos_token_id == 1
    assert final.usage.completion_tokens == 2
