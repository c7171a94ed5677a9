"""GenerateStream, the control plane's shared stream to a worker, on every worker.

Many attempts over one stream, each keyed by the attempt id the caller assigns (request_id
is for logs only): each gets its tokens and exactly one final (or one error event),
messages carry the news of several attempts at once, a message's cancels are handled
before its starts, and cancelling an attempt or closing the stream aborts the engine work.
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

from tests.integration.conformance.test_worker_conformance import (
    generate,
    load_report,
    request,
    running,
    wait_idle,
)
from tests.procs import Proc

pytestmark = pytest.mark.engine
FR = common_pb2.FinishReason
_CLOSE = object()


class Session:
    """A GenerateStream driven from a test: send() starts and cancels; events are
    collected by a reader thread, per attempt id."""

    def __init__(self, stub: Any) -> None:
        self._outgoing: queue.Queue[Any] = queue.Queue()
        self.call = stub.GenerateStream(self._requests(), timeout=60)
        self.messages = 0
        self.events: dict[int, list[Any]] = defaultdict(list)
        self.ended: dict[int, threading.Event] = defaultdict(threading.Event)
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
                        self.events[event.attempt_id].append(event)
                        if not event.HasField("chunk"):
                            self.ended[event.attempt_id].set()
        except grpc.RpcError as e:
            self.error = e

    def send(self, start: list[Any] | None = None, cancel: list[int] | None = None) -> None:
        """One StreamRequest: its cancels are handled before its starts."""
        self._outgoing.put(worker_pb2.StreamRequest(start=start or [], cancel=cancel or []))

    def start(self, *requests: Any) -> None:
        self.send(start=list(requests))

    def cancel(self, *attempt_ids: int) -> None:
        self.send(cancel=list(attempt_ids))

    def close(self) -> None:
        self._outgoing.put(_CLOSE)

    def close_and_drain(self, timeout: float = 30) -> None:
        """Half-close and read to the end: the worker ends the call once nothing is open."""
        self.close()
        self._reader.join(timeout)
        assert not self._reader.is_alive(), "the worker did not end the stream"
        assert self.error is None, self.error

    def wait(self, attempt_id: int, timeout: float = 60) -> tuple[list[int], Any]:
        """The ids streamed for `attempt_id` and its last event (a final or an error)."""
        assert self.ended[attempt_id].wait(timeout), f"attempt {attempt_id} did not end"
        with self._lock:
            events = list(self.events[attempt_id])
        last = events[-1]
        assert all(e.HasField("chunk") for e in events[:-1]), "an event after the end"
        ids = [t for e in events[:-1] for t in e.chunk.token_ids]
        return ids, last

    def tokens_so_far(self, attempt_id: int) -> int:
        with self._lock:
            return sum(len(e.chunk.token_ids) for e in self.events[attempt_id])

    def seen(self, attempt_id: int) -> list[Any]:
        with self._lock:
            return list(self.events.get(attempt_id, []))


def in_flight(stub: Any) -> int:
    """The requests the worker holds (its own count, which a leak keeps above zero),
    plus running and waiting ones in the engine, from one StreamLoad report."""
    report = load_report(stub)
    return int(report.in_flight) + int(report.running) + int(report.waiting)


def wait_nothing_in_flight(stub: Any, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while (left := in_flight(stub)) != 0:
        assert time.monotonic() < deadline, f"{left} still in flight {within_s} s later"
        time.sleep(0.01)


def bad_prompt(request_id: str, attempt_id: int) -> Any:
    req = request(max_tokens=4, request_id=request_id, attempt_id=attempt_id)
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
    attempts = list(range(1, 9))
    session.start(
        *(request(max_tokens=24, request_id=f"{engine}-many-{a}", attempt_id=a) for a in attempts)
    )
    for a in attempts:
        got, last = session.wait(a)
        assert last.HasField("final"), last
        assert last.final.finish_reason == FR.FINISH_REASON_LENGTH
        assert last.final.usage.completion_tokens == 24
        assert got == expected_ids  # greedy: the same tokens as a Generate call
    session.close_and_drain()
    # 8 requests x 24 tokens went out in far fewer messages than tokens.
    assert session.messages < 8 * 24 / 2, session.messages


def test_cancel_one_request_leaves_the_others(stub: Any, engine: str) -> None:
    session = Session(stub)
    long_attempt, short_attempt = 1, 2
    session.start(request(max_tokens=1500, request_id=f"{engine}-long", attempt_id=long_attempt))
    deadline = time.monotonic() + 30
    while session.tokens_so_far(long_attempt) < 3:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    session.cancel(long_attempt)
    session.start(request(max_tokens=8, request_id=f"{engine}-short", attempt_id=short_attempt))
    got, last = session.wait(short_attempt)
    assert len(got) == 8 and last.final.finish_reason == FR.FINISH_REASON_LENGTH
    wait_idle(stub, within_s=1.0)  # the cancelled request left the engine
    assert not session.ended[long_attempt].is_set()  # and sent nothing more after its cancel
    session.close()


def test_closing_the_stream_aborts_its_requests(stub: Any, engine: str) -> None:
    session = Session(stub)
    session.start(
        *(
            request(max_tokens=1500, request_id=f"{engine}-close-{a}", attempt_id=a)
            for a in (1, 2, 3)
        )
    )
    deadline = time.monotonic() + 30
    while running(stub) < 3:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    session.call.cancel()
    wait_idle(stub, within_s=1.0)


def test_bad_requests_get_error_events_naming_the_problem(stub: Any, engine: str) -> None:
    session = Session(stub)
    bad, good = 1, 3
    session.start(
        bad_prompt(f"{engine}-bad", attempt_id=bad),
        request(max_tokens=4, request_id=f"{engine}-no-attempt"),  # attempt_id 0
        request(max_tokens=400, request_id=f"{engine}-good", attempt_id=good),
    )
    _, refused = session.wait(bad)
    assert refused.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "prompt_token_ids[2]" in refused.error.message
    assert [v.field for v in refused.error.field_violations] == ["prompt_token_ids[2]"]
    _, missing = session.wait(0)
    assert missing.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "attempt_id" in missing.error.message
    assert [v.field for v in missing.error.field_violations] == ["attempt_id"]
    # A second start with an attempt id still open is refused; the open one is unharmed.
    session.start(request(max_tokens=4, request_id=f"{engine}-good-again", attempt_id=good))
    deadline = time.monotonic() + 60
    while not any(e.HasField("final") for e in session.seen(good)):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    events = session.seen(good)
    errors = [e.error.code for e in events if e.HasField("error")]
    assert errors == [grpc.StatusCode.ALREADY_EXISTS.value[0]]
    assert sum(len(e.chunk.token_ids) for e in events) == 400
    assert events[-1].HasField("final")
    session.close()


def test_timeout_ends_with_time_limit(stub: Any, engine: str) -> None:
    session = Session(stub)
    started = time.monotonic()
    session.start(
        request(max_tokens=1900, request_id=f"{engine}-timeout", attempt_id=1, timeout_ms=400)
    )
    got, last = session.wait(1)
    assert time.monotonic() - started < 0.4 + 0.2
    assert last.final.finish_reason == FR.FINISH_REASON_TIME_LIMIT
    assert last.final.usage.completion_tokens == len(got) < 1900
    wait_idle(stub, within_s=1.0)
    session.close()


def test_a_start_cancelled_in_its_own_message_never_starts(stub: Any, engine: str) -> None:
    session = Session(stub)
    for k in range(1, 21):
        req = request(max_tokens=50, request_id=f"{engine}-given-up-{k}", attempt_id=k)
        session.send(start=[req], cancel=[k])
    # Fresh attempts under the same request ids (a retry gets a new attempt id).
    for k in range(1, 21):
        session.start(
            request(max_tokens=6, request_id=f"{engine}-given-up-{k}", attempt_id=100 + k)
        )
    for k in range(1, 21):
        got, last = session.wait(100 + k)
        assert last.HasField("final"), last
        assert last.final.finish_reason == FR.FINISH_REASON_LENGTH
        assert len(got) == 6
    session.close_and_drain()
    never = {k: session.seen(k) for k in range(1, 21) if session.seen(k)}
    assert not never, f"attempts cancelled with their start sent events: {never}"
    wait_nothing_in_flight(stub, within_s=2.0)


def test_cancels_are_handled_before_starts(stub: Any, engine: str) -> None:
    session = Session(stub)
    rid = f"{engine}-retried"
    session.start(request(max_tokens=1500, request_id=rid, attempt_id=1))
    deadline = time.monotonic() + 30
    while session.tokens_so_far(1) < 3:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    # One message gives up attempt 1 and starts its retry, attempt 2, under the same request id.
    session.send(start=[request(max_tokens=8, request_id=rid, attempt_id=2)], cancel=[1])
    got, last = session.wait(2)
    assert last.HasField("final"), last
    assert last.final.finish_reason == FR.FINISH_REASON_LENGTH and len(got) == 8
    session.close_and_drain()
    assert not session.ended[1].is_set(), session.seen(1)[-1]  # nothing after its cancel
    assert session.tokens_so_far(1) < 1500
    wait_nothing_in_flight(stub, within_s=2.0)


def test_attempts_sharing_a_request_id_both_complete(stub: Any, engine: str) -> None:
    session = Session(stub)
    rid = f"{engine}-shared"
    session.start(
        request(max_tokens=12, request_id=rid, attempt_id=7),
        request(max_tokens=12, request_id=rid, attempt_id=8),
    )
    first, last7 = session.wait(7)
    second, last8 = session.wait(8)
    for last in (last7, last8):
        assert last.HasField("final"), last
        assert last.final.finish_reason == FR.FINISH_REASON_LENGTH
    assert len(first) == 12 and first == second  # greedy, the same prompt
    session.close_and_drain()
    wait_nothing_in_flight(stub, within_s=2.0)


def test_an_attempt_id_reused_after_its_cancel_runs_to_the_end(stub: Any) -> None:
    """The control plane never reuses an attempt id, but a worker must survive a caller
    that does: a new start right after the cancel of the same id runs to its final, and
    the old attempt's abort, still on its way to the engine, never hits it."""
    session = Session(stub)
    for round_ in range(30):
        session.start(request(max_tokens=64, request_id="r", attempt_id=1))
        session.cancel(1)
        session.start(request(max_tokens=2, request_id="r", attempt_id=1))
        session.cancel(1)
        del round_
    session.start(request(max_tokens=3, request_id="r", attempt_id=2))
    ids, last = session.wait(2)
    assert last.HasField("final") and len(ids) == 3
    session.close_and_drain()
    wait_nothing_in_flight(stub, within_s=30)


def test_a_cancelled_beam_search_leaves_nothing_held(stub: Any, engine: str) -> None:
    info = stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=5)
    if not info.capabilities.beam_search:
        pytest.skip(f"the {engine} worker declares no beam search (its refusal is tested in "
                    "test_worker_conformance.py)")  # fmt: skip

    session = Session(stub)
    session.start(request(max_tokens=1500, request_id=f"{engine}-beams", attempt_id=1,
                          beam_width=2))  # fmt: skip
    deadline = time.monotonic() + 10
    while in_flight(stub) == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    session.cancel(1)
    wait_nothing_in_flight(stub, within_s=5.0)  # the cancelled search is not held
    # The stream goes on: a short request on it after the cancel runs to its end.
    session.start(request(max_tokens=4, request_id=f"{engine}-after", attempt_id=2))
    got, last = session.wait(2)
    assert len(got) == 4 and last.final.finish_reason == FR.FINISH_REASON_LENGTH
    assert not session.ended[1].is_set()  # nothing was sent for the cancelled search
    session.close_and_drain()


def test_each_attempt_keeps_its_own_stream_interval(stub: Any, engine: str) -> None:
    from tests.integration.conformance.test_worker_conformance import check_cadence

    session = Session(stub)
    intervals = {1: 0, 2: 5, 3: 11}
    session.start(
        *(
            request(
                max_tokens=40, request_id=f"{engine}-cadence-{a}", attempt_id=a, stream_interval=n
            )
            for a, n in intervals.items()
        )
    )
    for a, n in intervals.items():
        got, last = session.wait(a)
        assert last.HasField("final") and last.final.usage.completion_tokens == 40 == len(got)
        sizes = [len(e.chunk.token_ids) for e in session.seen(a)[:-1]]
        if n > 1:
            check_cadence(sizes, 40, n)
    session.close_and_drain()
