"""KV-cache events (SubscribeKvEvents), on every worker (vLLM's publisher; the C++ worker's
simulator, from its prefix cache): the blocks a prompt leaves in the engine's cache arrive
as stored blocks with the prompt's own tokens, chained by the engine's hashes, so the
control plane's index (control/routing/kv_index) built from them knows which worker holds
the prompt."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from switchyard.v1 import common_pb2
from switchyard.worker.v1 import worker_pb2, worker_pb2_grpc

from control.routing.kv_index import KvIndex, prompt_keys
from tests.integration.conformance.test_worker_conformance import generate
from tests.procs import Proc

pytestmark = pytest.mark.engine


@pytest.fixture
def stub(any_worker: Proc) -> Iterator[Any]:
    with grpc.insecure_channel(any_worker.address) as channel:
        yield worker_pb2_grpc.WorkerStub(channel)


class Subscription:
    """SubscribeKvEvents read by a thread, batch by batch."""

    def __init__(self, stub: Any) -> None:
        self.call = stub.SubscribeKvEvents(worker_pb2.SubscribeKvEventsRequest(), timeout=120)
        self.batches: list[Any] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for batch in self.call:
                with self._lock:
                    self.batches.append(batch)
        except grpc.RpcError:
            pass  # cancelled at the end of the test

    def seen(self) -> list[Any]:
        with self._lock:
            return list(self.batches)

    def close(self) -> None:
        self.call.cancel()
        self._thread.join(10)


def test_kv_events_name_the_blocks_a_prompt_leaves(stub: Any, engine: str) -> None:
    info = stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=5)
    assert info.kv_events  # vLLM's publisher, the simulator's prefix cache
    block = info.kv_block_size
    prompt = [(7 * i + 3) % 500 + 2 for i in range(2 * block + 5)]  # two full blocks, and more
    sub = Subscription(stub)
    try:
        deadline = time.monotonic() + 30
        while not sub.seen():
            assert time.monotonic() < deadline, "no first batch"
            time.sleep(0.01)
        first = sub.seen()[0]
        assert first.reset, "a new subscription starts from a reset"
        while not any(b.snapshot_end for b in sub.seen()):
            assert time.monotonic() < deadline, "the snapshot never ended"
            time.sleep(0.01)
        req = worker_pb2.GenerateRequest(
            request_id="kv-events", prompt_token_ids=prompt, max_tokens=2, ignore_eos=True,
            sampling=common_pb2.SamplingParams(temperature=0.0),
        )  # fmt: skip
        generate(stub, req)
        keys = prompt_keys(prompt, block)
        deadline = time.monotonic() + 30
        while build_index(sub.seen()).overlap(keys, ["w"])["w"] < 2:
            assert time.monotonic() < deadline, f"the prompt's blocks never came: {sub.seen()}"
            time.sleep(0.05)
        stored = [e.stored for b in sub.seen() for e in b.events if e.HasField("stored")]
        assert all(s.block_size == block for s in stored)
        assert any(list(s.token_ids[:block]) == prompt[:block] for s in stored)
        # One more per batch of the engine's; the first batches (what the engine held
        # already) carry the sequence of the last before them.
        sequences = [b.sequence for b in sub.seen()]
        assert sequences == sorted(sequences)
        news = [b.sequence for b in sub.seen() if b.sequence > first.sequence]
        assert len(set(news)) == len(news)
        # One batch ends the snapshot, before any live one.
        ends = [i for i, b in enumerate(sub.seen()) if b.snapshot_end]
        assert len(ends) == 1
        assert all(b.sequence == first.sequence for b in sub.seen()[: ends[0] + 1])
    finally:
        sub.close()


def build_index(batches: list[Any]) -> KvIndex:
    """The control plane's index, from one subscription's batches."""
    index = KvIndex()
    for batch in batches:
        if batch.reset:
            index.cleared("w")
        for event in batch.events:
            if event.HasField("stored"):
                s = event.stored
                parent = s.parent_block_hash if s.HasField("parent_block_hash") else None
                index.stored("w", list(s.block_hashes), parent, list(s.token_ids), s.block_size)
            elif event.HasField("removed"):
                index.removed("w", list(event.removed.block_hashes))
            elif event.HasField("cleared"):
                index.cleared("w")
    return index


def test_a_late_subscriber_learns_what_the_engine_holds_already(stub: Any) -> None:
    """A control plane that subscribes after the engine cached a prompt (it restarted, or
    its stream broke) is told the prompt's blocks in its first batches, before any new
    event: the engine would not announce them again."""
    info = stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=5)
    block = info.kv_block_size
    prompt = [(11 * i + 5) % 500 + 2 for i in range(3 * block + 1)]
    req = worker_pb2.GenerateRequest(
        request_id="kv-late", prompt_token_ids=prompt, max_tokens=2, ignore_eos=True,
        sampling=common_pb2.SamplingParams(temperature=0.0),
    )  # fmt: skip
    keys = prompt_keys(prompt, block)
    # The worker reads its engine's events on their way: wait until an early subscriber
    # has seen the blocks, so the worker has too.
    early = Subscription(stub)
    try:
        generate(stub, req)
        deadline = time.monotonic() + 30
        while build_index(early.seen()).overlap(keys, ["w"])["w"] < 3:
            assert time.monotonic() < deadline, "the prompt's blocks never came"
            time.sleep(0.05)
    finally:
        early.close()
    late = Subscription(stub)
    try:
        deadline = time.monotonic() + 30
        while True:
            seen = late.seen()
            # The snapshot: the batches up to the one that says it ends there.
            ends = [i for i, b in enumerate(seen) if b.snapshot_end]
            if ends:
                break
            assert time.monotonic() < deadline, (
                f"the late subscriber's snapshot never ended: {seen}"
            )
            time.sleep(0.05)
        snapshot = seen[: ends[0] + 1]
        assert build_index(snapshot).overlap(keys, ["w"])["w"] >= 3
        assert seen[0].reset and not any(b.reset for b in snapshot[1:])
        # They all carry the sequence of the last batch before the subscription.
        assert {b.sequence for b in snapshot} == {seen[0].sequence}
    finally:
        late.close()
