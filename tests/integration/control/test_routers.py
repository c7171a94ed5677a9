"""`switchyard serve --routers 2`: two control-plane processes on one port.

Connections spread across the processes; whichever answers, Admin calls reach the
supervisor (the only process that owns the workers), a drain reaches every router, and
stopping the supervisor stops its routers.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil
import pytest
from switchyard.v1 import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc

from control.fleet.local_workers import free_port
from tests.procs import Proc, start_process, wait_serving

CONNECTIONS = 12


@pytest.fixture(scope="module")
def routed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    tmp = tmp_path_factory.mktemp("routers")
    port = free_port()
    config = tmp / "sim.yaml"
    config.write_text(
        f"listen: 127.0.0.1:{port}\n"
        "models:\n"
        "  - name: sim-tiny\n"
        "    engine: sim\n"
        "    model: builtin:tiny\n"
        "    replicas: 2\n"
        "    routing: round_robin\n"
        "    engine_args: {max_context: 2048, decode_step_us: 500}\n"
    )
    argv = ["-m", "control", "serve", "--config", str(config), "--routers", "2"]
    proc = start_process(argv, port, tmp, "ctl")
    try:
        wait_serving(proc, "sim-tiny", timeout=120)
        yield proc
    finally:
        assert proc.stop() == 0, proc.log_tail()


def channels(address: str) -> list[grpc.Channel]:
    """Separate TCP connections (no shared subchannel), as separate clients would open."""
    return [
        grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(CONNECTIONS)
    ]


def request(max_tokens: int = 8) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        model="sim-tiny",
        text="Hello",
        stopping=generation_pb2.StoppingParams(max_tokens=max_tokens, ignore_eos=True),
    )


def listeners(port: int) -> set[int]:
    return {
        c.pid
        for c in psutil.net_connections("tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid
    }


def complete(channel: grpc.Channel) -> generation_pb2.CompleteResponse:
    stub = generation_pb2_grpc.GenerationStub(channel)
    return stub.Complete(request(), timeout=30)


def test_two_processes_share_the_port_and_both_answer(routed: Proc) -> None:
    port = int(routed.address.rpartition(":")[2])
    pids = listeners(port)
    assert len(pids) == 2, pids
    assert routed.popen.pid in pids
    chans = channels(routed.address)
    try:
        for ch in chans:
            out = complete(ch)
            assert len(out.token_ids) == 8
        # Each connection landed on one of the processes; the kernel spread them.
        served = set()
        for pid in pids:
            for c in psutil.Process(pid).net_connections("tcp"):
                if c.status == psutil.CONN_ESTABLISHED and c.laddr.port == port:
                    served.add(pid)
        assert served == pids, "one process took every connection"
    finally:
        for ch in chans:
            ch.close()


def test_admin_reaches_the_supervisor_and_drains_reach_every_router(routed: Proc) -> None:
    chans = channels(routed.address)
    try:
        listed = [
            admin_pb2_grpc.AdminStub(ch).ListWorkers(admin_pb2.ListWorkersRequest(), timeout=10)
            for ch in chans
        ]
        # Only the supervisor started the workers: every answer is its view.
        for answer in listed:
            assert [w.local for w in answer.workers] == [True, True]
        drained = listed[0].workers[0].address
        admin = admin_pb2_grpc.AdminStub(chans[-1])
        admin.DrainWorker(admin_pb2.DrainWorkerRequest(address=drained, grace_s=5), timeout=30)
        # Routers follow the supervisor every second: soon no process routes there.
        deadline = time.monotonic() + 15
        while any(complete(ch).final.worker == drained for ch in chans for _ in range(2)):
            assert time.monotonic() < deadline, "a router still routes to the drained worker"
            time.sleep(0.1)
        for ch in chans:
            for _ in range(2):  # round robin would use both workers
                assert complete(ch).final.worker != drained
    finally:
        for ch in chans:
            ch.close()


def test_a_model_loaded_at_run_time_is_served_by_every_process(routed: Proc) -> None:
    with grpc.insecure_channel(routed.address) as ch:
        admin = admin_pb2_grpc.AdminStub(ch)
        spec = admin_pb2.ModelSpec(name="sim-late", engine="sim", model="builtin:tiny")
        admin.LoadModel(admin_pb2.LoadModelRequest(spec=spec), timeout=60)
    # The supervisor replaces its routers with ones that know the new model.
    req = request()
    req.model = "sim-late"
    deadline = time.monotonic() + 60
    while True:
        chans = channels(routed.address)
        try:
            answers = []
            for channel in chans:
                try:
                    stub = generation_pb2_grpc.GenerationStub(channel)
                    answers.append(len(stub.Complete(req, timeout=30).token_ids))
                except grpc.RpcError as e:
                    answers.append(e.code())
        finally:
            for channel in chans:
                channel.close()
        if answers == [8] * CONNECTIONS:
            break
        assert time.monotonic() < deadline, answers
        time.sleep(0.5)


def test_stopping_the_supervisor_stops_its_routers(tmp_path: Path) -> None:
    port = free_port()
    config = tmp_path / "one.yaml"
    config.write_text(
        f"listen: 127.0.0.1:{port}\nmodels:\n"
        "  - {name: sim-tiny, engine: sim, model: builtin:tiny}\n"
    )
    argv = ["-m", "control", "serve", "--config", str(config), "--routers", "3"]
    proc = start_process(argv, port, tmp_path, "ctl3")
    try:
        wait_serving(proc, "sim-tiny", timeout=120)
        pids = listeners(port)
        assert len(pids) == 3
    finally:
        assert proc.stop() == 0, proc.log_tail()
    deadline = time.monotonic() + 20
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids):
        assert time.monotonic() < deadline, "a router outlived its supervisor"
        time.sleep(0.1)
