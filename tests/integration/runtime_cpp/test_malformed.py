"""The C++ worker given bytes that are not a valid encoding of the request: every RPC
answers INVALID_ARGUMENT naming the message type, with a BadRequest on `request`, and
logs it once with the peer; on GenerateStream such a message fails that stream alone,
its request cancelled, while another stream's request finishes."""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from switchyard.worker.v1 import worker_pb2, worker_pb2_grpc

from control.fleet.local_workers import cpp_worker_binary, free_port
from tests.integration.fuzz import wire
from tests.integration.fuzz.test_public_api import worker_in_flight
from tests.procs import Proc, start_process, wait_serving

SERVICE = "/switchyard.worker.v1.Worker/"
RPCS = wire.worker_rpcs()
GARBAGE = wire.GARBAGE


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    tmp: Path = tmp_path_factory.mktemp("cpp-malformed")
    port = free_port()
    args = ["--engine", "sim", "--model", "sim-malformed", "--port", str(port)]
    args += ["--sim-vocab-size", "512", "--sim-max-context", "65536"]
    args += ["--sim-decode-step-us", "2000"]
    proc: Proc = start_process(args, port, tmp, "cpp-malformed", executable=cpp_worker_binary())
    try:
        wait_serving(proc, timeout=30)
        yield proc
    finally:
        assert proc.stop() == 0, proc.log_tail()


class Requests:
    """A request stream fed from the test (messages, or bytes on a raw call): iterating
    blocks until the next one; close() ends it."""

    def __init__(self) -> None:
        self._queue: queue.Queue[object] = queue.Queue()

    def put(self, message: object) -> None:
        self._queue.put(message)

    def close(self) -> None:
        self._queue.put(None)

    def __iter__(self) -> Iterator[object]:
        while (message := self._queue.get()) is not None:
            yield message


def log_since(proc: Proc, mark: int) -> str:
    return proc.log_path.read_text(errors="replace")[mark:]


def test_every_rpc_answers_a_body_that_does_not_parse(worker: Proc) -> None:
    mark = len(worker.log_path.read_text(errors="replace"))
    with grpc.insecure_channel(worker.address) as channel:
        for rpc in RPCS:
            with pytest.raises(grpc.RpcError) as caught:
                wire.send(channel, rpc, GARBAGE, timeout=10)
            wire.assert_malformed(caught.value, rpc.type_name, len(GARBAGE))
        # Well-formed calls still answer.
        stub: Any = worker_pb2_grpc.WorkerStub(channel)
        assert stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=5).engine == "sim"
    lines = [line for line in log_since(worker, mark).splitlines() if "malformed request" in line]
    for method in (rpc.method for rpc in RPCS):
        logged = [line for line in lines if f" method={method} " in line]
        assert len(logged) == 1, (method, lines)
        assert logged[0].startswith("[cpp-worker] malformed request ")
        assert " peer=ipv4:127.0.0.1:" in logged[0]
        assert logged[0].endswith(f" bytes={len(GARBAGE)}")
    assert worker_in_flight(worker.address) == 0


def test_a_message_that_does_not_parse_fails_only_its_stream(worker: Proc) -> None:
    mark = len(worker.log_path.read_text(errors="replace"))
    prompt = list(range(10, 42))
    with grpc.insecure_channel(worker.address) as channel:
        stub: Any = worker_pb2_grpc.WorkerStub(channel)
        good_requests = Requests()
        good = stub.GenerateStream(iter(good_requests), timeout=60)
        good_requests.put(
            worker_pb2.StreamRequest(
                start=[
                    worker_pb2.GenerateRequest(
                        attempt_id=1, prompt_token_ids=prompt, max_tokens=300, ignore_eos=True
                    )
                ]
            )
        )
        good_events = iter(good)
        first: Any = next(good_events)  # it runs
        tokens = sum(len(e.chunk.token_ids) for e in first.events)

        bad_requests = Requests()
        bad = channel.stream_stream(
            SERVICE + "GenerateStream", request_serializer=None, response_deserializer=None
        )(iter(bad_requests), timeout=60)
        # Long enough that only a cancel ends it within the test.
        bad_requests.put(
            worker_pb2.StreamRequest(
                start=[
                    worker_pb2.GenerateRequest(
                        attempt_id=1, prompt_token_ids=prompt, max_tokens=60000, ignore_eos=True
                    )
                ]
            ).SerializeToString()
        )
        bad_events = iter(bad)
        running = worker_pb2.StreamResponse.FromString(next(bad_events))
        assert running.events[0].attempt_id == 1 and running.events[0].HasField("chunk")
        bad_requests.put(GARBAGE)
        with pytest.raises(grpc.RpcError) as caught:
            for _ in bad_events:
                pass
        wire.assert_malformed(caught.value, "switchyard.worker.v1.StreamRequest", len(GARBAGE))
        bad_requests.close()

        final: Any = None
        for message in good_events:
            for e in message.events:
                tokens += len(e.chunk.token_ids)
                if e.HasField("final"):
                    final = e.final
            if final is not None:
                break
        good_requests.close()
        assert final is not None, "the other stream's request did not finish"
        assert final.usage.completion_tokens == 300
        assert tokens == 300
        assert good.code() is grpc.StatusCode.OK

    deadline = time.monotonic() + 10
    while (left := worker_in_flight(worker.address)) != 0:
        assert time.monotonic() < deadline, f"{left} still in flight: the bad stream's request"
        time.sleep(0.05)
    logged = [line for line in log_since(worker, mark).splitlines() if "malformed request" in line]
    assert len(logged) == 1, logged
    assert f"method={SERVICE}GenerateStream peer=ipv4:127.0.0.1:" in logged[0]
