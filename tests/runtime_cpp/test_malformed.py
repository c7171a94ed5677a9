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
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from switchyard.worker.v1 import worker_pb2, worker_pb2_grpc

from control.fleet.supervisor import cpp_worker_binary, free_port
from tests.fuzz.test_public_api import worker_in_flight
from tests.procs import Proc, start_process, wait_serving

# A truncated varint where a field tag belongs: no message parses it (random bytes may).
GARBAGE = b"\xff\xff\xff\xff\xff"
SERVICE = "/switchyard.worker.v1.Worker/"
# method -> (request type, request stream, response stream)
RPCS = {
    "Generate": ("GenerateRequest", False, True),
    "GenerateStream": ("StreamRequest", True, True),
    "Abort": ("AbortRequest", False, False),
    "GetInfo": ("GetInfoRequest", False, False),
    "StreamLoad": ("StreamLoadRequest", False, True),
    "LoadAdapter": ("LoadAdapterRequest", False, False),
    "UnloadAdapter": ("UnloadAdapterRequest", False, False),
    "SubscribeKvEvents": ("SubscribeKvEventsRequest", False, True),
}


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


def raw_call(channel: grpc.Channel, method: str, body: bytes) -> None:
    """One call of `method` with `body` as its request (the only message of a stream)."""
    _, request_stream, response_stream = RPCS[method]
    kind = ("stream" if request_stream else "unary") + "_"
    kind += "stream" if response_stream else "unary"
    stub = getattr(channel, kind)(
        SERVICE + method, request_serializer=None, response_deserializer=None
    )
    result = stub(iter([body]) if request_stream else body, timeout=10)
    if response_stream:
        list(result)


def assert_malformed(err: grpc.RpcError, type_name: str, size: int) -> None:
    code = err.code()
    details = err.details()
    assert code is grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    message = f"request body is not a valid encoding of switchyard.worker.v1.{type_name}"
    assert details == f"{message} ({size} bytes)"
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    assert status is not None, "no google.rpc.Status details"
    assert len(status.details) == 1
    bad = error_details_pb2.BadRequest()
    assert status.details[0].Unpack(bad)
    assert [(v.field, v.description) for v in bad.field_violations] == [("request", details)]


def log_since(proc: Proc, mark: int) -> str:
    return proc.log_path.read_text(errors="replace")[mark:]


def test_every_rpc_answers_a_body_that_does_not_parse(worker: Proc) -> None:
    mark = len(worker.log_path.read_text(errors="replace"))
    with grpc.insecure_channel(worker.address) as channel:
        for method, (type_name, _, _) in RPCS.items():
            with pytest.raises(grpc.RpcError) as caught:
                raw_call(channel, method, GARBAGE)
            assert_malformed(caught.value, type_name, len(GARBAGE))
        # Well-formed calls still answer.
        stub: Any = worker_pb2_grpc.WorkerStub(channel)
        assert stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=5).engine == "sim"
    lines = [line for line in log_since(worker, mark).splitlines() if "malformed request" in line]
    for method in RPCS:
        logged = [line for line in lines if f" method={SERVICE}{method} " in line]
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
        assert_malformed(caught.value, "StreamRequest", len(GARBAGE))
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
