"""Generated GenerateStream sessions on every worker: messages that start and cancel
attempts in any order, reuse attempt ids (open or over), share request ids, send attempt
id 0 and bad prompts. Whatever the sequence, every event belongs to an attempt that was
started, each accepted start ends exactly once (a final or one error), errors are the
caller's (INVALID_ARGUMENT, ALREADY_EXISTS), the stream ends when the caller closes it,
and the worker holds nothing afterwards."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from switchyard.worker.v1 import worker_pb2, worker_pb2_grpc

from tests.integration.conformance.test_generate_stream import in_flight
from tests.integration.conformance.test_worker_conformance import request
from tests.integration.fuzz.generated import examples
from tests.procs import Proc

pytestmark = pytest.mark.engine
CALLER_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT.value[0], grpc.StatusCode.ALREADY_EXISTS.value[0]}


@st.composite
def starts(draw: st.DrawFn) -> Any:
    req = request(
        max_tokens=draw(st.integers(1, 6)),
        request_id=draw(st.sampled_from(["a", "a", "b", ""])),
        attempt_id=draw(st.integers(0, 6)),
    )
    if draw(st.integers(0, 5)) == 0:
        req.prompt_token_ids[:] = [0, 99999]  # outside the vocabulary
    return req


messages = st.lists(
    st.builds(
        lambda start, cancel: worker_pb2.StreamRequest(start=start, cancel=cancel),
        st.lists(starts(), max_size=3),
        st.lists(st.integers(0, 6), max_size=3),
    ),
    min_size=1,
    max_size=6,
)


def play(stub: Any, sequence: list[Any]) -> Counter[str]:
    responses = stub.GenerateStream(iter(sequence), timeout=60)
    ends: Counter[int] = Counter()
    seen: Counter[str] = Counter()
    started = {s.attempt_id for m in sequence for s in m.start}
    for response in responses:  # ends once every attempt is over: the caller closed
        for event in response.events:
            assert event.attempt_id in started, f"an event for attempt {event.attempt_id}"
            which = event.WhichOneof("event")
            seen[which] += 1
            if which == "error":
                assert event.error.code in CALLER_ERRORS, event.error
                assert event.error.message
            if which != "chunk":
                ends[event.attempt_id] += 1
    # One end per start that was not taken back by a cancel in its own message, at most.
    for attempt_id, n in ends.items():
        offered = sum(
            1
            for m in sequence
            for s in m.start
            if s.attempt_id == attempt_id and attempt_id not in m.cancel
        )
        assert n <= offered, f"attempt {attempt_id} ended {n} times for {offered} starts"
    return seen


def test_generated_stream_sessions(any_worker: Proc) -> None:
    seen: Counter[str] = Counter()
    with grpc.insecure_channel(any_worker.address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)

        @settings(
            max_examples=examples(40),
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=[HealthCheck.too_slow],
        )
        @given(sequence=messages)
        def one(sequence: list[Any]) -> None:
            seen.update(play(stub, sequence))

        one()
        deadline = time.monotonic() + 30
        while (left := in_flight(stub)) != 0:
            assert time.monotonic() < deadline, f"{left} requests still held 30 s later"
            time.sleep(0.05)
    assert seen["final"] > 0 and seen["error"] > 0
