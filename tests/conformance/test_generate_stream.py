"""GenerateStream, the control plane's shared stream to a worker, on every worker.

Many requests over one stream: each gets its tokens and exactly one final (or one error
event), messages carry the news of several requests at once, and cancelling a request
or closing the stream aborts the engine work.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from switchyard.v1 import common_pb2
from switchyard.worker.v1 import worker_pb2, worker_pb2_grpc

from tests.conformance.test_worker_conformance import generate, request, running, wait_idle
from tests.procs import Proc

pytestmark = pytest.mark.engine
FR = common_pb2.FinishReason
_CLOSE = object()


class Session:
    """A GenerateStream driven from a test: send() starts and cancels; events are
    collected by a reader thread, per request id."""

    def __init__(self, stub: Any) -> None:
        self._outgoing: queue.Queue[Any] = queue.Queue()
        self.call = stub.GenerateStream(self._requests(), timeout=60)
        self.messages = 0
        self.events: dict[str, list[Any]] = defaultdict(list)
        self.ended: dict[str, threading.Event] = defaultdict(threading.Event)
        self.error: grpc.RpcError | None = None
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _requests(self) -> Iterator[Any]:
        while (item := self._outgoing.get()) is not _CLOSE:
            yield item

    def _read(self) -> None:
        try:
            for message in self.call:
                with self._lock:
                    self.messages += 1
                    for event in message.events:
                        self.events[event.request_id].append(event)
                        if not event.HasField("chunk"):
                            self.ended[event.request_id].set()
        except grpc.RpcError as e:
            self.error = e

    def start(self, *requests: Any) -> None:
        self._outgoing.put(worker_pb2.StreamRequest(start=list(requests)))

    def cancel(self, *request_ids: str) -> None:
        self._outgoing.put(worker_pb2.StreamRequest(cancel=list(request_ids)))

    def close(self) -> None:
        self._outgoing.put(_CLOSE)

    def wait(self, request_id: str, timeout: float = 60) -> tuple[list[int], Any]:
        """The ids streamed for `request_id` and its last event (a final or an error)."""
        assert self.ended[request_id].wait(timeout), f"{request_id} did not end"
        with self._lock:
            events = list(self.events[request_id])
        last = events[-1]
        assert all(e.HasField("chunk") for e in events[:-1]), "an event after the end"
        ids = [t for e in events[:-1] for t in e.chunk.token_ids]
        return ids, last

    def tokens_so_far(self, request_id: str) -> int:
        with self._lock:
            return sum(len(e.chunk.token_ids) for e in self.events[request_id])


def bad_prompt(request_id: str) -> Any:
    req = request(max_tokens=4, request_id=request_id)
    req.prompt_token_ids[:] = [0, 5, 99999]
    return req


@pytest.fixture
def stub(any_worker: Proc) -> Iterator[Any]:
    with grpc.insecure_channel(any_worker.address) as channel:
        yield worker_pb2_grpc.WorkerStub(channel)


def test_get_info_offers_generate_stream(stub: Any) -> None:
    assert stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=10).generate_stream


def test_many_requests_share_messages_and_match_generate(stub: Any, engine: str) -> None:
    expected, _ = generate(stub, request(max_tokens=24))
    expected_ids = [t for c in expected for t in c.token_ids]
    session = Session(stub)
    ids = [f"{engine}-many-{i}" for i in range(8)]
    session.start(*(request(max_tokens=24, request_id=rid) for rid in ids))
    for rid in ids:
        got, last = session.wait(rid)
        assert last.HasField("final"), last
        assert last.final.finish_reason == FR.FINISH_REASON_LENGTH
        assert last.final.usage.completion_tokens == 24
        assert got == expected_ids  # greedy: the same tokens as a Generate call
    session.close()
    session._reader.join(10)
    assert session.error is None
    # 8 requests x 24 tokens went out in far fewer messages than tokens.
    assert session.messages < 8 * 24 / 2, session.messages


def test_cancel_one_request_leaves_the_others(stub: Any, engine: str) -> None:
    session = Session(stub)
    long_id, short_id = f"{engine}-cancel-long", f"{engine}-cancel-short"
    session.start(request(max_tokens=1500, request_id=long_id))
    deadline = time.monotonic() + 30
    while session.tokens_so_far(long_id) < 3:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    session.cancel(long_id)
    session.start(request(max_tokens=8, request_id=short_id))
    got, last = session.wait(short_id)
    assert len(got) == 8 and last.final.finish_reason == FR.FINISH_REASON_LENGTH
    wait_idle(stub, within_s=1.0)  # the cancelled request left the engine
    assert not session.ended[long_id].is_set()  # and sent nothing more after its cancel
    session.close()


def test_closing_the_stream_aborts_its_requests(stub: Any, engine: str) -> None:
    session = Session(stub)
    rids = [f"{engine}-close-{i}" for i in range(3)]
    session.start(*(request(max_tokens=1500, request_id=rid) for rid in rids))
    deadline = time.monotonic() + 30
    while running(stub) < 3:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    session.call.cancel()
    wait_idle(stub, within_s=1.0)


def test_bad_requests_get_error_events_naming_the_problem(stub: Any, engine: str) -> None:
    session = Session(stub)
    good = f"{engine}-good"
    session.start(
        bad_prompt(f"{engine}-bad"),
        request(max_tokens=4, request_id=""),
        request(max_tokens=400, request_id=good),
    )
    _, bad = session.wait(f"{engine}-bad")
    assert bad.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "prompt_token_ids[2]" in bad.error.message
    _, missing = session.wait("")
    assert missing.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "request_id" in missing.error.message
    # A second request with an id still in flight is refused; the first is unharmed.
    session.start(request(max_tokens=4, request_id=good))
    deadline = time.monotonic() + 60
    while not any(e.HasField("final") for e in list(session.events[good])):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    events = list(session.events[good])
    errors = [e.error.code for e in events if e.HasField("error")]
    assert errors == [grpc.StatusCode.ALREADY_EXISTS.value[0]]
    assert sum(len(e.chunk.token_ids) for e in events) == 400
    assert events[-1].HasField("final")
    session.close()


def test_timeout_ends_with_time_limit(stub: Any, engine: str) -> None:
    session = Session(stub)
    rid = f"{engine}-timeout"
    started = time.monotonic()
    session.start(request(max_tokens=1900, request_id=rid, timeout_ms=400))
    got, last = session.wait(rid)
    assert time.monotonic() - started < 0.4 + 0.2
    assert last.final.finish_reason == FR.FINISH_REASON_TIME_LIMIT
    assert last.final.usage.completion_tokens == len(got) < 1900
    wait_idle(stub, within_s=1.0)
    session.close()
