"""The control plane under faults and load, with real processes and real gRPC: C++
simulator workers that the control plane starts, supervises and routes to."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status
from switchyard.v1 import admin_pb2, admin_pb2_grpc, common_pb2, generation_pb2, generation_pb2_grpc
from switchyard.worker.v1 import worker_pb2, worker_pb2_grpc

from control.fleet.local_workers import free_port
from tests.procs import Proc, start_process, wait_serving, worker_pid

FR = common_pb2.FinishReason


def serve(tmp: Path, model_yaml: str, name: str = "ctl", front: str = "python") -> Proc:
    port = free_port()
    config = tmp / f"{name}.yaml"
    config.write_text(f"listen: 127.0.0.1:{port}\napi: {{front: {front}}}\nmodels:\n{model_yaml}")
    proc = start_process(["-m", "control", "serve", "--config", str(config)], port, tmp, name)
    wait_serving(proc, timeout=120)
    return proc


@pytest.fixture
def stopping(request: pytest.FixtureRequest) -> Iterator[list[Proc]]:
    procs: list[Proc] = []
    yield procs
    for p in procs:
        code = p.stop()
        assert code == 0, f"control plane exited with {code}:\n{p.log_tail()}"


def req(max_tokens: int, text: str = "Hello", **kw: object) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        model="sim",
        text=text,
        stopping=generation_pb2.StoppingParams(max_tokens=max_tokens, ignore_eos=True),
        **kw,  # type: ignore[arg-type]
    )


def healthy_workers(stub: generation_pb2_grpc.GenerationStub) -> int:
    models = stub.ListModels(generation_pb2.ListModelsRequest(), timeout=5).models
    return int(models[0].healthy_workers)


SIM_MODEL = (
    "  - name: sim\n"
    "    engine: sim\n"
    "    model: builtin:tiny\n"
    "    replicas: {replicas}\n"
    "    routing: {routing}\n"
    "    engine_args: {{decode_step_us: {step}, max_context: 2048}}\n"
    "    health: {{canary_interval_s: 0.3, canary_timeout_s: 0.3, failure_threshold: 2}}\n"
    "    limits: {{max_concurrency: {conc}, max_queue: {queue}}}\n"
)


def sim_model(
    replicas: int = 2,
    routing: str = "round_robin",
    step: int = 2000,
    conc: int = 256,
    queue: int = 1024,
) -> str:
    return SIM_MODEL.format(replicas=replicas, routing=routing, step=step, conc=conc, queue=queue)


async def _stream(
    stub: generation_pb2_grpc.GenerationStub,
    n: int,
    text: str,
    started: asyncio.Event | None = None,
) -> str:
    tokens = 0
    try:
        async for msg in stub.Generate(req(n, text), timeout=60):
            if msg.HasField("chunk"):
                tokens += len(msg.chunk.token_ids)
                if started is not None:
                    started.set()
            else:
                assert msg.final.finish_reason == FR.FINISH_REASON_LENGTH
                assert msg.final.usage.completion_tokens == tokens == n
                return "complete"
    except grpc.aio.AioRpcError as e:
        assert e.code() == grpc.StatusCode.UNAVAILABLE, e
        assert e.details()
        return "unavailable"
    raise AssertionError("stream ended without a final or a status")


@pytest.mark.parametrize("front", ["python", "native"])
async def test_kill_9_mid_stream_resumes_and_the_worker_rejoins(
    tmp_path: Path, stopping: list[Proc], front: str
) -> None:
    ctl = serve(tmp_path, sim_model(replicas=2, step=3000), front=front)
    stopping.append(ctl)
    async with grpc.aio.insecure_channel(ctl.address) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        first = await stub.Complete(req(2), timeout=10)
        victim = first.final.worker
        pid = worker_pid(victim)
        started = asyncio.Event()
        streams = [asyncio.create_task(_stream(stub, 300, f"s{i}", started)) for i in range(20)]
        async with asyncio.timeout(30):  # kill mid-stream: once tokens flow
            await started.wait()
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        outcomes = Counter(await asyncio.wait_for(asyncio.gather(*streams), 60))
        took = time.monotonic() - killed_at
    assert sum(outcomes.values()) == 20
    assert outcomes["complete"] == 20, outcomes  # the other replica took them over
    print(f"\nkill -9 failover: 20 streams finished {took:.2f} s after the kill")
    # The supervisor restarts the worker and it rejoins the pool.
    with grpc.insecure_channel(ctl.address) as ch:
        sync_stub = generation_pb2_grpc.GenerationStub(ch)
        deadline = time.monotonic() + 20
        while healthy_workers(sync_stub) < 2:
            assert time.monotonic() < deadline, "the killed worker did not rejoin"
            await asyncio.sleep(0.1)
        rejoined = time.monotonic() - killed_at
        print(f"kill -9 failover: worker back in the pool {rejoined:.2f} s after the kill")
        assert worker_pid(victim) != pid
    assert "worker exited" in ctl.log_path.read_text()


def test_sigstop_worker_is_ejected_by_the_canary_and_comes_back(
    tmp_path: Path, stopping: list[Proc]
) -> None:
    ctl = serve(tmp_path, sim_model(replicas=2, step=1000))
    stopping.append(ctl)
    with grpc.insecure_channel(ctl.address) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        victim = stub.Complete(req(2), timeout=10).final.worker
        pid = worker_pid(victim)
        os.kill(pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            while healthy_workers(stub) != 1:
                assert time.monotonic() - stopped_at < 3.0, "hung worker not ejected"
                time.sleep(0.05)
            ejected = time.monotonic() - stopped_at
            print(f"\nSIGSTOP: worker ejected {ejected:.2f} s after it hung")
            for _ in range(10):  # traffic flows to the other worker
                out = stub.Complete(req(5), timeout=5)
                assert out.final.worker != victim
                assert out.final.usage.completion_tokens == 5
        finally:
            os.kill(pid, signal.SIGCONT)
        resumed_at = time.monotonic()
        while healthy_workers(stub) != 2:
            assert time.monotonic() - resumed_at < 10.0, "worker did not come back"
            time.sleep(0.05)
        print(f"SIGCONT: worker back {time.monotonic() - resumed_at:.2f} s after it resumed")


async def test_overload_gives_resource_exhausted_with_retry_info(
    tmp_path: Path, stopping: list[Proc]
) -> None:
    ctl = serve(tmp_path, sim_model(replicas=1, step=2000, conc=4, queue=4))
    stopping.append(ctl)
    results: list[str] = []

    async def one(stub: generation_pb2_grpc.GenerationStub, i: int) -> None:
        try:
            out = await stub.Complete(req(50, f"o{i}"), timeout=30)
            assert out.final.usage.completion_tokens == 50
            results.append("ok")
        except grpc.aio.AioRpcError as e:
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            status = rpc_status.from_call(e)  # type: ignore[arg-type]
            retry = error_details_pb2.RetryInfo()
            assert status is not None and any(d.Unpack(retry) for d in status.details)
            assert retry.retry_delay.ToMilliseconds() > 0
            results.append("exhausted")

    async with grpc.aio.insecure_channel(ctl.address) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        await asyncio.gather(*(one(stub, i) for i in range(30)))
    counts = Counter(results)
    assert counts["ok"] >= 8  # 4 running + 4 queued at least
    assert counts["exhausted"] >= 10
    assert counts["ok"] + counts["exhausted"] == 30


def test_deadline_ends_with_time_limit_and_frees_the_worker(
    tmp_path: Path, stopping: list[Proc]
) -> None:
    ctl = serve(tmp_path, sim_model(replicas=1, step=2000))
    stopping.append(ctl)
    with grpc.insecure_channel(ctl.address) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        started = time.monotonic()
        out = stub.Complete(req(1500), timeout=0.2)
        assert time.monotonic() - started < 0.5
        assert out.final.finish_reason == FR.FINISH_REASON_TIME_LIMIT
        assert 0 < out.final.usage.completion_tokens < 1500
        with grpc.insecure_channel(out.final.worker) as wch:
            wstub = worker_pb2_grpc.WorkerStub(wch)
            deadline = time.monotonic() + 1.0
            while True:
                call = wstub.StreamLoad(worker_pb2.StreamLoadRequest(interval_ms=10), timeout=5)
                running = next(iter(call)).running
                call.cancel()
                if running == 0:
                    break
                assert time.monotonic() < deadline, "worker still running after the deadline"


def test_prefix_affinity_keeps_a_shared_prefix_on_one_worker(
    tmp_path: Path, stopping: list[Proc]
) -> None:
    ctl = serve(tmp_path, sim_model(replicas=4, routing="prefix_affinity", step=500))
    stopping.append(ctl)
    shared = list(range(10, 10 + 96))  # six 16-token blocks
    with grpc.insecure_channel(ctl.address) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        workers = Counter()
        cached = 0
        for i in range(40):
            r = generation_pb2.GenerateRequest(
                model="sim",
                token_ids=generation_pb2.TokenIds(ids=[*shared, 200 + i, 300 + i]),
                stopping=generation_pb2.StoppingParams(max_tokens=4, ignore_eos=True),
            )
            out = stub.Complete(r, timeout=10)
            workers[out.final.worker] += 1
            cached += out.final.usage.cached_prompt_tokens
        share = workers.most_common(1)[0][1] / 40
        print(f"\nprefix_affinity: {share:.0%} of 40 shared-prefix requests on one of 4 workers")
        assert share >= 0.9
        assert cached > 0  # the simulator reports the prefix cache hits
        # Different prefixes spread over the workers.
        spread = Counter()
        for i in range(40):
            r = generation_pb2.GenerateRequest(
                model="sim",
                token_ids=generation_pb2.TokenIds(ids=[i % 250 + 5] * 64),
                stopping=generation_pb2.StoppingParams(max_tokens=2, ignore_eos=True),
            )
            spread[stub.Complete(r, timeout=10).final.worker] += 1
        assert len(spread) >= 3


@pytest.mark.parametrize("front", ["python", "native"])
def test_sigterm_drains_in_flight_streams(tmp_path: Path, front: str) -> None:
    ctl = serve(tmp_path, sim_model(replicas=1, step=2000), front=front)
    with grpc.insecure_channel(ctl.address) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        health = health_pb2_grpc.HealthStub(ch)
        call = stub.Generate(req(400), timeout=30)  # about 0.8 s of work
        first = next(call)
        assert first.HasField("chunk")
        ctl.popen.send_signal(signal.SIGTERM)
        # Soon no longer SERVING (or no longer accepting), while the stream goes on.
        deadline = time.monotonic() + 10
        while True:
            try:
                r = health.Check(health_pb2.HealthCheckRequest(service="sim"), timeout=2)
            except grpc.RpcError:
                break
            if r.status != health_pb2.HealthCheckResponse.SERVING:
                break
            assert time.monotonic() < deadline, "still SERVING 10 s after SIGTERM"
            time.sleep(0.02)
        rest = list(call)
    assert rest[-1].HasField("final")
    assert rest[-1].final.finish_reason == FR.FINISH_REASON_LENGTH
    assert rest[-1].final.usage.completion_tokens == 400
    assert ctl.popen.wait(30) == 0


def test_bad_config_fails_at_start_naming_the_key(tmp_path: Path) -> None:
    import subprocess
    import sys

    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "models:\n  - name: x\n    engine: vllm\n    model: builtin:tiny\n    replicas: 0\n"
    )
    out = subprocess.run(
        [sys.executable, "-m", "control", "serve", "--config", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 2
    assert "models[0].replicas" in out.stderr


def test_model_health_follows_its_workers(tmp_path: Path, stopping: list[Proc]) -> None:
    ctl = serve(tmp_path, sim_model(replicas=1, step=1000))
    stopping.append(ctl)
    with grpc.insecure_channel(ctl.address) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        health = health_pb2_grpc.HealthStub(ch)

        def status(service: str) -> int:
            r = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
            return int(r.status)

        pid = worker_pid(stub.Complete(req(2), timeout=10).final.worker)
        assert status("sim") == health_pb2.HealthCheckResponse.SERVING
        os.kill(pid, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 3
            while status("sim") != health_pb2.HealthCheckResponse.NOT_SERVING:
                assert time.monotonic() < deadline, "model still SERVING with its only worker hung"
                time.sleep(0.05)
            assert status("") == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.RpcError) as info:
                stub.Complete(req(2), timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
            assert "no healthy worker" in info.value.details()  # type: ignore[attr-defined]
        finally:
            os.kill(pid, signal.SIGCONT)
        deadline = time.monotonic() + 5
        while status("sim") != health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() < deadline, "model did not come back"
            time.sleep(0.05)


def test_streams_on_a_hung_worker_move_to_another(tmp_path: Path, stopping: list[Proc]) -> None:
    ctl = serve(tmp_path, sim_model(replicas=2, step=2000))
    stopping.append(ctl)
    with grpc.insecure_channel(ctl.address) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        call = stub.Generate(req(600), timeout=30)  # no hang even without a tight deadline
        first = next(call)
        tokens = len(first.chunk.token_ids)
        # Which worker has it? The one whose load shows a running request.
        admin = admin_pb2_grpc.AdminStub(ch)
        busy = [w for w in admin.ListWorkers(admin_pb2.ListWorkersRequest()).workers if w.in_flight]
        assert len(busy) == 1
        pid = worker_pid(busy[0].address)
        os.kill(pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            final = None
            for msg in call:
                if msg.HasField("chunk"):
                    tokens += len(msg.chunk.token_ids)
                else:
                    final = msg.final
            moved_after = time.monotonic() - started
        finally:
            os.kill(pid, signal.SIGCONT)
    assert final is not None and final.finish_reason == FR.FINISH_REASON_LENGTH
    assert tokens == final.usage.completion_tokens == 600
    assert final.worker != busy[0].address
    print(f"\nhung worker: its stream finished on another worker {moved_after:.2f} s later")
