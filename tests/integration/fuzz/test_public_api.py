"""Generated public requests against the control plane: on C++ simulator workers (many
cases, fast) and on the real vLLM worker (fewer). Batches of up to three calls run at
once, so reused request ids, admission limits and cancels overlap. Afterwards the service
is healthy and nothing is left in flight anywhere."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from switchyard.v1 import admin_pb2, admin_pb2_grpc, generation_pb2_grpc
from switchyard.worker.v1 import worker_pb2, worker_pb2_grpc

from tests.integration.fuzz.generated import Plan, examples, plans, run
from tests.procs import Proc, serving_control

IDLE_WITHIN_S = 30.0


@pytest.fixture(scope="module", params=["python", "native"])
def sim_control(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Proc]:
    """On each api.front."""
    models = (
        "  - name: sim\n"
        "    engine: sim\n"
        "    model: builtin:tiny\n"
        "    replicas: 2\n"
        "    limits: {max_concurrency: 4, max_queue: 2}\n"
        "    engine_args: {max_context: 2048, decode_step_us: 300}\n"
    )
    tmp = tmp_path_factory.mktemp(f"fuzz-{request.param}")
    settings = f"api: {{front: {request.param}}}\n"
    with serving_control(tmp, models, "sim", settings=settings, timeout=120) as proc:
        yield proc


def fuzz(address: str, model: str, count: int) -> Counter[str]:
    outcomes: Counter[str] = Counter()
    with grpc.insecure_channel(address) as channel, ThreadPoolExecutor(3) as pool:
        stub = generation_pb2_grpc.GenerationStub(channel)

        @settings(
            max_examples=count,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(batch=st.lists(plans(model), min_size=1, max_size=3))
        def one_batch(batch: list[Plan]) -> None:
            outcomes.update(pool.map(lambda plan: run(stub, plan), batch))

        one_batch()
    return outcomes


def assert_healthy_and_idle(address: str, model: str) -> None:
    """SERVING, and within a few engine steps nothing in flight on the control plane's
    side nor on any worker's (the workers' own count)."""
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        status = health.Check(health_pb2.HealthCheckRequest(service=model), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        admin = admin_pb2_grpc.AdminStub(channel)
        deadline = time.monotonic() + IDLE_WITHIN_S
        while True:
            listed = admin.ListWorkers(admin_pb2.ListWorkersRequest(model=model), timeout=10)
            busy = {w.address: w.in_flight for w in listed.workers if w.in_flight}
            busy.update(
                {a: n for a in (w.address for w in listed.workers) if (n := worker_in_flight(a))}
            )
            if not busy:
                return
            assert time.monotonic() < deadline, f"still in flight {IDLE_WITHIN_S} s later: {busy}"
            time.sleep(0.05)


def worker_in_flight(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        stub: Any = worker_pb2_grpc.WorkerStub(channel)
        call = stub.StreamLoad(worker_pb2.StreamLoadRequest(interval_ms=10), timeout=5)
        report = next(iter(call))
        call.cancel()
        return int(report.in_flight) + int(report.running) + int(report.waiting)


def test_generated_requests_on_simulator_workers(sim_control: Proc, capsys: Any) -> None:
    outcomes = fuzz(sim_control.address, "sim", examples(300))
    assert_healthy_and_idle(sim_control.address, "sim")
    with capsys.disabled():
        print(f"\nfuzz on simulator workers: {sum(outcomes.values())} calls, {dict(outcomes)}")
    assert outcomes["OK"] > 0 and outcomes["INVALID_ARGUMENT"] > 0


@pytest.mark.engine
def test_generated_requests_on_the_vllm_worker(control: Proc, capsys: Any) -> None:
    outcomes = fuzz(control.address, "tiny", examples(40))
    assert_healthy_and_idle(control.address, "tiny")
    with capsys.disabled():
        print(f"\nfuzz on the vLLM worker: {sum(outcomes.values())} calls, {dict(outcomes)}")
    assert outcomes["OK"] > 0


def test_the_fuzz_size_is_a_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWITCHYARD_FUZZ_EXAMPLES", "10000")
    assert examples(300) == 10000 and examples(40) >= 1000
    monkeypatch.delenv("SWITCHYARD_FUZZ_EXAMPLES")
    assert examples(300) == 300
