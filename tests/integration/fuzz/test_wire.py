"""Hostile bytes on every port, beside the field-level fuzz: a body that does not parse is
INVALID_ARGUMENT naming the message type, with a BadRequest on `request`, on every RPC of
every server (the control plane's public API, Admin, health and reflection, and the vLLM
worker here; the C++ worker in tests/integration/runtime_cpp/test_malformed.py); generated random
bodies, truncations and bit flips never end UNKNOWN or INTERNAL, on the C++ worker too,
and the service is healthy and idle afterwards.

SWITCHYARD_WIRE_FUZZ_CASES=10000 ./scripts/test tests/integration/fuzz/test_wire.py -s runs the full
size (calls per server); CI runs a few hundred."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from switchyard.v1 import generation_pb2
from switchyard.worker.v1 import worker_pb2

from control.fleet.local_workers import cpp_worker_binary, free_port
from tests.integration.fuzz import wire
from tests.integration.fuzz.test_public_api import assert_healthy_and_idle, worker_in_flight
from tests.procs import Proc, serving_control, start_process, wait_serving

IDLE_S = 2.0  # the sim control plane's api.request_idle_s
IDLE_WITHIN_S = 30.0


@pytest.fixture(scope="module", params=["python", "native"])
def sim_plane(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Proc]:
    """On each api.front."""
    models = (
        "  - name: sim\n"
        "    engine: sim\n"
        "    model: builtin:tiny\n"
        "    engine_args: {max_context: 2048, decode_step_us: 300}\n"
    )
    settings = f"api: {{request_idle_s: {IDLE_S}, front: {request.param}}}\n"
    tmp = tmp_path_factory.mktemp(f"wire-{request.param}")
    with serving_control(tmp, models, "sim", settings=settings, timeout=120) as proc:
        yield proc


@pytest.fixture(scope="module")
def cpp_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    tmp: Path = tmp_path_factory.mktemp("wire-cpp")
    port = free_port()
    args = ["--engine", "sim", "--model", "sim-wire", "--port", str(port)]
    args += ["--sim-vocab-size", "512", "--sim-decode-step-us", "300"]
    proc = start_process(args, port, tmp, "cpp", executable=cpp_worker_binary())
    try:
        wait_serving(proc, timeout=30)
        yield proc
    finally:
        assert proc.stop() == 0, proc.log_tail()


def plane_rpcs(model: str) -> list[wire.Rpc]:
    return [
        *wire.generation_rpcs(model),
        *wire.admin_rpcs(model),
        *wire.health_rpcs(model),
        *wire.reflection_rpcs(),
    ]


def worker_rpcs() -> list[wire.Rpc]:
    return [*wire.worker_rpcs(), *wire.health_rpcs(""), *wire.reflection_rpcs()]


def test_a_body_that_does_not_parse_on_the_control_plane(sim_plane: Proc) -> None:
    with grpc.insecure_channel(sim_plane.address) as channel:
        for rpc in plane_rpcs("sim"):
            with pytest.raises(grpc.RpcError) as caught:
                wire.send(channel, rpc, wire.GARBAGE, timeout=10)
            wire.assert_malformed(caught.value, rpc.type_name)
    logged = sim_plane.log_path.read_text()
    assert "malformed request" in logged and "peer=ipv4:127.0.0.1:" in logged
    assert "Traceback" not in logged and "DecodeError" not in logged
    assert_healthy_and_idle(sim_plane.address, "sim")


@pytest.mark.engine
def test_a_body_that_does_not_parse_on_the_vllm_worker(worker: Proc) -> None:
    with grpc.insecure_channel(worker.address) as channel:
        for rpc in worker_rpcs():
            with pytest.raises(grpc.RpcError) as caught:
                wire.send(channel, rpc, wire.GARBAGE, timeout=10)
            wire.assert_malformed(caught.value, rpc.type_name)
    assert "malformed request" in worker.log_path.read_text()


@pytest.mark.engine
def test_a_bad_message_mid_stream_fails_only_its_stream(worker: Proc) -> None:
    """GenerateStream on the vLLM worker: a message that does not parse, after a good
    one, ends that stream INVALID_ARGUMENT; another stream's request finishes."""
    start = worker_pb2.GenerateRequest(
        prompt_token_ids=[5, 6, 7, 8], max_tokens=400, ignore_eos=True, attempt_id=1
    )
    first = worker_pb2.StreamRequest(start=[start]).SerializeToString()
    sent_bad = threading.Event()

    def hostile() -> Iterator[bytes]:
        yield first
        sent_bad.wait(30)  # the good request is running by then
        yield wire.GARBAGE

    short = worker_pb2.GenerateRequest(prompt_token_ids=[9, 10], max_tokens=8, attempt_id=1)
    with grpc.insecure_channel(worker.address) as channel:
        method = "/switchyard.worker.v1.Worker/GenerateStream"
        raw = channel.stream_stream(method, request_serializer=None, response_deserializer=None)
        bad_stream = raw(hostile(), timeout=60)
        first_event = worker_pb2.StreamResponse.FromString(next(bad_stream))
        assert first_event.events and first_event.events[0].attempt_id == 1
        sent_bad.set()
        with pytest.raises(grpc.RpcError) as caught:
            for _ in bad_stream:
                pass
        wire.assert_malformed(caught.value, "switchyard.worker.v1.StreamRequest")

        other = raw(iter([worker_pb2.StreamRequest(start=[short]).SerializeToString()]), timeout=60)
        events = [e for m in other for e in worker_pb2.StreamResponse.FromString(m).events]
        assert events[-1].WhichOneof("event") == "final", events[-1]
    assert _idle(worker.address)


def test_health_lists_every_service(sim_plane: Proc) -> None:
    """grpc.health.v1 List (the asyncio servicer of grpcio-health-checking leaves it
    unimplemented): every service with its status."""
    with grpc.insecure_channel(sim_plane.address) as channel:
        listed = health_pb2_grpc.HealthStub(channel).List(
            health_pb2.HealthListRequest(), timeout=10
        )
    serving = health_pb2.HealthCheckResponse.SERVING
    assert listed.statuses["sim"].status == serving
    assert listed.statuses["switchyard.v1.Generation"].status == serving


def test_a_call_that_never_sends_its_request_ends_at_the_idle_limit(sim_plane: Proc) -> None:
    """A client that opens a call and sends nothing holds it for api.request_idle_s,
    then hears DEADLINE_EXCEEDED; others are served meanwhile."""
    never = threading.Event()

    def nothing() -> Iterator[bytes]:
        never.wait(60)
        yield b""

    with grpc.insecure_channel(sim_plane.address) as channel:
        method = "/switchyard.v1.Generation/Complete"
        opened = channel.stream_unary(method, request_serializer=None, response_deserializer=None)
        began = time.monotonic()
        future = opened.future(nothing(), timeout=60)
        stub = channel.unary_unary(
            "/switchyard.v1.Generation/ListModels",
            request_serializer=generation_pb2.ListModelsRequest.SerializeToString,
            response_deserializer=generation_pb2.ListModelsResponse.FromString,
        )
        assert [m.name for m in stub(generation_pb2.ListModelsRequest(), timeout=10).models]
        with pytest.raises(grpc.RpcError) as caught:
            future.result(timeout=30)
        took = time.monotonic() - began
        never.set()
    err: Any = caught.value
    assert err.code() is grpc.StatusCode.DEADLINE_EXCEEDED, err
    assert "request idle limit" in err.details()
    assert "switchyard.v1.GenerateRequest" in err.details()
    assert IDLE_S <= took < IDLE_S + 10, took


def run_fuzz(
    address: str, rpcs: list[wire.Rpc], count: int, pid: int, name: str, capsys: Any
) -> None:
    fds, rss = wire.usage(pid)
    seen = wire.fuzz(address, rpcs, count)
    after_fds, after_rss = wire.usage(pid)
    with capsys.disabled():
        codes = dict(wire.totals(seen).most_common())
        print(
            f"\nwire fuzz on {name}: {sum(codes.values())} calls, {codes}; "
            f"fds {fds} -> {after_fds}, RSS {rss // 1024} -> {after_rss // 1024} MiB"
        )
    assert not wire.server_faults(seen), wire.server_faults(seen)
    assert wire.totals(seen)["INVALID_ARGUMENT"] > 0


def test_wire_fuzz_on_the_control_plane(sim_plane: Proc, capsys: Any) -> None:
    run_fuzz(
        sim_plane.address,
        plane_rpcs("sim"),
        wire.cases(400),
        sim_plane.popen.pid,
        "the control plane (simulator model)",
        capsys,
    )
    assert_healthy_and_idle(sim_plane.address, "sim")


def test_wire_fuzz_on_the_cpp_worker(cpp_worker: Proc, capsys: Any) -> None:
    run_fuzz(
        cpp_worker.address,
        wire.worker_rpcs(),
        wire.cases(300),
        cpp_worker.popen.pid,
        "the C++ worker (simulator)",
        capsys,
    )
    assert _idle(cpp_worker.address)


@pytest.mark.engine
def test_wire_fuzz_on_the_vllm_worker(worker: Proc, capsys: Any) -> None:
    run_fuzz(
        worker.address,
        worker_rpcs(),
        wire.cases(300),
        worker.popen.pid,
        "the vLLM worker",
        capsys,
    )
    assert _idle(worker.address)


@pytest.mark.engine
def test_wire_fuzz_on_the_control_plane_before_vllm(control: Proc, capsys: Any) -> None:
    run_fuzz(
        control.address,
        wire.generation_rpcs("tiny"),
        wire.cases(200),
        control.popen.pid,
        "the control plane (vLLM model)",
        capsys,
    )
    assert_healthy_and_idle(control.address, "tiny")


def _idle(address: str) -> bool:
    deadline = time.monotonic() + IDLE_WITHIN_S
    while (left := worker_in_flight(address)) != 0:
        assert time.monotonic() < deadline, f"{left} still in flight on {address}"
        time.sleep(0.05)
    return True
