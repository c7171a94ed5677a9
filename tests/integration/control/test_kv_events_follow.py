"""The control plane follows a worker's KV-cache events into its model's index: a scripted
worker (a gRPC server speaking the worker API) streams batches; the index holds what they
say, and forgets the worker when its stream resets or breaks, until the next subscription
says again."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio  # type: ignore[attr-defined]
from switchyard.worker.v1 import worker_pb2, worker_pb2_grpc

from control.config import ModelSpec
from control.fleet.lifecycle import ModelLoader
from control.fleet.local_workers import free_port
from control.fleet.models import ModelRegistry
from control.routing.kv_index import KvIndex, prompt_keys
from control.workers import health
from control.workers.client import WorkerClient

BLOCK = 4
TOKENS = list(range(100, 112))  # three blocks


def removed(hashes: list[int]) -> Any:
    return worker_pb2.KvEvent(removed=worker_pb2.KvBlocksRemoved(block_hashes=hashes))


def stored(hashes: list[int], parent: int | None, tokens: list[int]) -> Any:
    s = worker_pb2.KvBlocksStored(block_hashes=hashes, token_ids=tokens, block_size=BLOCK)
    if parent is not None:
        s.parent_block_hash = parent
    return worker_pb2.KvEvent(stored=s)


class EventsWorker(worker_pb2_grpc.WorkerServicer):  # type: ignore[misc]
    """Each subscription gets the next script; a script ends its stream with an error. An
    `asyncio.Event` in a script holds the stream there until it is set."""

    def __init__(self, scripts: list[list[Any]]) -> None:
        self.scripts = scripts
        self.subscriptions = 0
        self.release = asyncio.Event()  # lets the current stream end

    async def GetInfo(self, request: Any, context: Any) -> Any:
        return worker_pb2.GetInfoResponse(engine="scripted", kv_block_size=BLOCK, kv_events=True)

    async def SubscribeKvEvents(self, request: Any, context: Any) -> AsyncIterator[Any]:
        script = self.scripts[min(self.subscriptions, len(self.scripts) - 1)]
        self.subscriptions += 1
        for batch in script:
            if isinstance(batch, asyncio.Event):
                await batch.wait()
                continue
            yield batch
        await self.release.wait()
        self.release.clear()
        await context.abort(grpc.StatusCode.UNAVAILABLE, "worker restarting")


async def serve(worker: EventsWorker, healthy: bool = False) -> tuple[grpc.aio.Server, str]:
    """A started gRPC server for the scripted worker (and a SERVING health service), and
    its address."""
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(worker, server)
    if healthy:
        serving = health_aio.HealthServicer()
        await serving.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(serving, server)
    port = server.add_insecure_port(f"127.0.0.1:{free_port()}")
    await server.start()
    return server, f"127.0.0.1:{port}"


def holding_three_blocks() -> list[Any]:
    """A subscription's snapshot, in one batch: the engine holds TOKENS' three blocks."""
    return [
        worker_pb2.KvEventBatch(
            sequence=7, reset=True, events=[stored([11, 12, 13], None, TOKENS)], snapshot_end=True
        ),
    ]


async def until(check: Callable[[], bool], what: str, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while not check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def watched(
    scripted: EventsWorker, sink: bool = True
) -> AsyncIterator[tuple[WorkerClient, KvIndex]]:
    """A client of the scripted worker, with its GetInfo, an index (given as its sink
    unless `sink` is False) and the watcher running; all stopped on the way out."""
    server, at = await serve(scripted)
    client = WorkerClient(at)
    index = KvIndex()
    watcher: asyncio.Task[None] | None = None
    try:
        await client.fetch_info()
        assert client.info is not None and client.info.kv_events
        if sink:
            client.kv_sink = index
        watcher = asyncio.create_task(health.watch_kv_events(client, client.stub))
        yield client, index
    finally:
        if watcher is not None:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
        await client.channel.close()
        await server.stop(None)


async def test_the_index_follows_a_workers_events_and_forgets_it_on_a_break() -> None:
    first = [
        worker_pb2.KvEventBatch(sequence=0, reset=True),
        worker_pb2.KvEventBatch(sequence=1, events=[stored([11, 12], None, TOKENS[:8])]),
        worker_pb2.KvEventBatch(sequence=2, events=[stored([13], 12, TOKENS[8:])]),
        worker_pb2.KvEventBatch(sequence=3, events=[removed([13])]),
    ]
    second = [
        worker_pb2.KvEventBatch(sequence=0, reset=True),
        worker_pb2.KvEventBatch(sequence=1, events=[stored([21], None, TOKENS[:4])]),
    ]
    scripted = EventsWorker([first, second])
    keys = prompt_keys(TOKENS, BLOCK)
    async with watched(scripted) as (client, index):
        address = client.address
        # Two blocks stored, a third after them, then the third removed: two held.
        await until(lambda: scripted.subscriptions == 1 and len(index) == 2, "first events")
        assert index.overlap(keys, [address]) == {address: 2}
        # The stream breaks: the worker is forgotten, then the next subscription refills it.
        scripted.release.set()
        await until(lambda: scripted.subscriptions == 2 and len(index) == 1, "resubscribed")
        assert index.overlap(keys, [address]) == {address: 1}
    assert len(index) == 0  # the watcher's end forgets it


async def test_a_model_that_loads_has_its_workers_cache_before_it_routes(
    monkeypatch: Any,
) -> None:
    # A control plane that restarts finds the engines' caches full: the watcher subscribes
    # as soon as its model gives it a sink (not at its next retry, here 60 s away), and the
    # model waits for the snapshot, which says what the engine holds.
    monkeypatch.setattr(health, "KV_RESUBSCRIBE_S", 60.0)
    scripted = EventsWorker([holding_three_blocks()])
    async with watched(scripted, sink=False) as (client, index):  # the watcher before the sink
        address = client.address
        for _ in range(20):  # it runs until it waits for a sink
            await asyncio.sleep(0)
        assert scripted.subscriptions == 0
        assert await health.wait_kv_synced([client], 0.0) == []  # no sink: nothing to wait
        unknown = WorkerClient("127.0.0.1:1")  # no GetInfo yet: not waited for either
        unknown.kv_sink = index
        assert await health.wait_kv_synced([unknown], 0.0) == []
        await unknown.channel.close()
        client.kv_sink = index
        assert await health.wait_kv_synced([client], 10.0) == []
        assert scripted.subscriptions == 1
        assert index.overlap(prompt_keys(TOKENS, BLOCK), [address]) == {address: 3}
        # The stream breaks: not synced until the next subscription's snapshot.
        scripted.release.set()
        await until(lambda: not client.kv_synced.is_set(), "stream ended")
        assert await health.wait_kv_synced([client], 0.05) == [address]


async def test_a_model_waits_for_the_end_of_the_snapshot_not_its_first_batch() -> None:
    # A large cache comes in several batches; only the last says the snapshot ends. A
    # worker that does not say so ends the wait with its first live batch (a later
    # sequence).
    rest, live = asyncio.Event(), asyncio.Event()
    marked = [
        worker_pb2.KvEventBatch(
            sequence=7, reset=True, events=[stored([11, 12], None, TOKENS[:8])]
        ),
        rest,
        worker_pb2.KvEventBatch(
            sequence=7, events=[stored([13], 12, TOKENS[8:])], snapshot_end=True
        ),
    ]
    unmarked = [
        worker_pb2.KvEventBatch(sequence=7, reset=True, events=[stored([11], None, TOKENS[:4])]),
        live,
        worker_pb2.KvEventBatch(sequence=8, events=[stored([12], 11, TOKENS[4:8])]),
    ]
    scripted = EventsWorker([marked, unmarked])
    keys = prompt_keys(TOKENS, BLOCK)
    async with watched(scripted) as (client, index):
        address = client.address
        await until(lambda: len(index) == 2, "the snapshot's first batch")
        assert await health.wait_kv_synced([client], 0.05) == [address]
        rest.set()
        assert await health.wait_kv_synced([client], 10.0) == []
        assert index.overlap(keys, [address]) == {address: 3}
        # The next subscription's worker does not mark the end.
        scripted.release.set()
        await until(lambda: scripted.subscriptions == 2 and len(index) == 1, "resubscribed")
        assert await health.wait_kv_synced([client], 0.05) == [address]
        live.set()
        assert await health.wait_kv_synced([client], 10.0) == []
        assert index.overlap(keys, [address]) == {address: 2}


class ServingEventsWorker(EventsWorker):
    async def GetInfo(self, request: Any, context: Any) -> Any:
        return worker_pb2.GetInfoResponse(
            engine="scripted",
            kv_block_size=BLOCK,
            kv_events=True,
            max_context=4096,
            vocab_size=1 << 20,
        )


async def test_a_loaded_model_routes_from_what_the_engine_held_before_it_loaded() -> None:
    scripted = ServingEventsWorker([holding_three_blocks()])
    server, address = await serve(scripted, healthy=True)
    loader = ModelLoader(ModelRegistry(), "127.0.0.1")
    try:
        spec = ModelSpec(name="m", engine="vllm", model="builtin:tiny", workers=[address])
        entry = await loader.load(spec)
        assert entry.policy.name == "kv_aware"  # the default where workers report events
        # No waiting here: load returned once the worker's snapshot was in the index.
        assert entry.kv_index is not None
        assert entry.kv_index.overlap(prompt_keys(TOKENS, BLOCK), [address]) == {address: 3}
    finally:
        await loader.stop_all()
        await server.stop(None)
