"""The engine's KV-cache events, for SubscribeKvEvents.

vLLM publishes them from its engine-core process (`kv_events_config`, a ZMQ PUB socket;
0.26 and 0.32 alike): one message per engine step, `[topic, sequence (8 bytes, big
endian), msgpack batch]`, the batch `[timestamp, events, data-parallel rank]`, each event
a map with a "type" (BlockStored, BlockRemoved, AllBlocksCleared). The worker turns its
engine's publisher on at an ipc socket of its own (`engine_kwargs`), reads it here, and
hands every subscriber the same `KvEventBatch` messages. It keeps what the engine holds
(blocks stored less those removed), so a new subscriber's first batches are that, after a
reset: it learns the cache as it is, not only what is stored from then on. A subscriber
that falls behind is dropped (its stream ends; it subscribes again and starts from a
reset); a gap in the engine's own sequence reaches every subscriber as a reset, and what
was held is forgotten (it is no longer known).
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from collections.abc import AsyncGenerator, Iterator
from typing import Any

import structlog
from switchyard.worker.v1 import worker_pb2

log = structlog.get_logger(__name__)

TOPIC = b"kv"
QUEUE_BATCHES = 4096  # per subscriber, before it counts as fallen behind
SNAPSHOT_BLOCKS_PER_BATCH = 1024  # what a new subscriber is told the engine holds


def engine_kwargs(kwargs: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """`kwargs` (AsyncEngineArgs') with the engine's KV-cache events published at an ipc
    socket of this worker's, and that endpoint; unchanged (None) where the caller set
    kv_events_config itself or turned prefix caching off (then nothing is stored)."""
    if "kv_events_config" in kwargs or kwargs.get("enable_prefix_caching") is False:
        return kwargs, None
    from vllm.config import KVEventsConfig

    path = os.path.join(tempfile.mkdtemp(prefix="switchyard-kv-"), "events.sock")
    endpoint = f"ipc://{path}"
    config = KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint, topic=TOPIC.decode()
    )
    return {**kwargs, "kv_events_config": config}, endpoint


def _hash(value: Any) -> int:
    """An engine block hash as the events carry it: an int (vLLM's default) or the
    digest's bytes, whose last 8 bytes (big endian) are what the int form is."""
    if isinstance(value, bytes | bytearray):
        return int.from_bytes(value[-8:], "big")
    return int(value) & 0xFFFFFFFFFFFFFFFF


def to_event(raw: Any) -> Any | None:
    """One vLLM event (a map) as a KvEvent; None for what is not about the main cache."""
    if not isinstance(raw, dict):
        return None
    kind = raw.get("type")
    medium = raw.get("medium")
    if medium not in (None, "GPU"):  # an offloading tier's copy, not the engine's cache
        return None
    if kind == "BlockStored":
        stored = worker_pb2.KvBlocksStored(
            block_hashes=[_hash(h) for h in raw.get("block_hashes", ())],
            token_ids=[int(t) for t in raw.get("token_ids", ())],
            block_size=int(raw.get("block_size", 0)),
            adapter=str(raw.get("lora_name") or ""),
        )
        parent = raw.get("parent_block_hash")
        if parent is not None:
            stored.parent_block_hash = _hash(parent)
        return worker_pb2.KvEvent(stored=stored)
    if kind == "BlockRemoved":
        hashes = [_hash(h) for h in raw.get("block_hashes", ())]
        return worker_pb2.KvEvent(removed=worker_pb2.KvBlocksRemoved(block_hashes=hashes))
    if kind == "AllBlocksCleared":
        return worker_pb2.KvEvent(cleared=worker_pb2.KvCacheCleared())
    return None


class KvEvents:
    """The engine's events, read once and fanned out."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self._subscribers: set[asyncio.Queue[Any]] = set()
        self._sequence = 0  # this worker's, per batch sent
        self._engine_sequence: int | None = None
        self._task: asyncio.Task[None] | None = None
        # What the engine holds: its hash -> (parent hash, tokens, block size, adapter),
        # in the order stored.
        self.held: dict[int, tuple[int | None, list[int], int, str]] = {}

    def start_once(self) -> None:
        """Read the engine's events from now on: at the server's start (so that the
        socket is connected before the first subscriber's first prompt) and again by a
        subscriber after a failure."""
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._read(), name="kv-events")

    async def subscribe(self) -> AsyncGenerator[Any, None]:
        """Batches from now on, the first with reset set; ends when this subscriber
        falls behind (or the worker stops)."""
        queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=QUEUE_BATCHES)
        self._subscribers.add(queue)
        try:
            # Taken with the subscription, between two batches of the engine's (one event
            # loop), so nothing falls between the snapshot and what follows it; its
            # batches are built one at a time, the event loop free between them.
            for batch in self.snapshot():
                yield batch
                await asyncio.sleep(0)
            while (batch := await queue.get()) is not None:
                yield batch
        finally:
            self._subscribers.discard(queue)

    def snapshot(self) -> Iterator[Any]:
        """A reset, then every block the engine holds now, each after its parent,
        `SNAPSHOT_BLOCKS_PER_BATCH` a batch (built as they are taken); the last batch has
        `snapshot_end` set."""
        return self._snapshot(dict(self.held), self._sequence)

    @staticmethod
    def _snapshot(
        held: dict[int, tuple[int | None, list[int], int, str]], sequence: int
    ) -> Iterator[Any]:
        now = time.time()
        batch = worker_pb2.KvEventBatch(sequence=sequence, reset=True, timestamp_s=now)
        sent: set[int] = set()
        for engine_hash in held:
            chain: list[int] = []  # this block's ancestors not yet sent, nearest first
            h: int | None = engine_hash
            while h is not None and h in held and h not in sent:
                chain.append(h)
                sent.add(h)
                h = held[h][0]
            for h in reversed(chain):
                if len(batch.events) >= SNAPSHOT_BLOCKS_PER_BATCH:
                    yield batch
                    batch = worker_pb2.KvEventBatch(sequence=sequence, timestamp_s=now)
                parent, tokens, size, adapter = held[h]
                stored = worker_pb2.KvBlocksStored(
                    block_hashes=[h], token_ids=tokens, block_size=size, adapter=adapter
                )
                if parent is not None:
                    stored.parent_block_hash = parent
                batch.events.append(worker_pb2.KvEvent(stored=stored))
        batch.snapshot_end = True
        yield batch

    def _apply(self, events: list[Any], gap: bool) -> None:
        """Keep `held` as the engine's cache: blocks stored, less removed."""
        if gap:
            self.held.clear()  # what it holds now is not known: nothing is claimed
        for e in events:
            kind = e.WhichOneof("kind")
            if kind == "stored":
                s = e.stored
                size = s.block_size
                if size <= 0 or len(s.token_ids) != size * len(s.block_hashes):
                    continue
                parent = s.parent_block_hash if s.HasField("parent_block_hash") else None
                for i, h in enumerate(s.block_hashes):
                    tokens = list(s.token_ids[i * size : (i + 1) * size])
                    self.held.pop(h, None)  # stored again: it goes to the end
                    self.held[h] = (parent, tokens, size, s.adapter)
                    parent = h
            elif kind == "removed":
                for h in e.removed.block_hashes:
                    self.held.pop(h, None)
            elif kind == "cleared":
                self.held.clear()

    def _publish(self, batch: Any) -> None:
        self._sequence += 1
        batch.sequence = self._sequence
        for queue in list(self._subscribers):
            try:
                queue.put_nowait(batch)
            except asyncio.QueueFull:  # fallen behind: its stream ends
                self._subscribers.discard(queue)
                self._end(queue)
                log.warning("kv-events subscriber fell behind; dropped")

    @staticmethod
    def _end(queue: asyncio.Queue[Any]) -> None:
        """End a subscriber's stream: what it has not read is dropped."""
        while not queue.empty():
            queue.get_nowait()
        queue.put_nowait(None)

    def handle(self, frames: list[bytes]) -> None:
        """One message from the engine's publisher."""
        import msgspec

        if len(frames) != 3 or len(frames[1]) != 8:
            log.warning("kv-events message of an unknown shape", frames=len(frames))
            return
        seq = int.from_bytes(frames[1], "big")
        gap = self._engine_sequence is not None and seq != self._engine_sequence + 1
        self._engine_sequence = seq
        decoded = msgspec.msgpack.decode(frames[2])
        timestamp, raw_events = float(decoded[0]), decoded[1]
        events = [e for e in (to_event(r) for r in raw_events) if e is not None]
        self._apply(events, gap)
        if not events and not gap:
            return
        self._publish(worker_pb2.KvEventBatch(reset=gap, events=events, timestamp_s=timestamp))

    async def _read(self) -> None:
        import zmq
        import zmq.asyncio

        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.SUB)
        failed = False
        try:
            sock.connect(self.endpoint)
            sock.setsockopt(zmq.SUBSCRIBE, TOPIC)
            while True:
                frames = await sock.recv_multipart()
                try:
                    self.handle(frames)
                except Exception:  # a batch it cannot read: the subscribers must resync
                    log.warning("kv-events batch not understood", exc_info=True)
                    self._engine_sequence = None
                    self.held.clear()
                    self._publish(worker_pb2.KvEventBatch(reset=True))
        except Exception:
            failed = True
            log.error("kv-events reader failed; subscribers are ended", exc_info=True)
            raise
        finally:
            sock.close(linger=0)
            ctx.term()
            if failed:  # their streams end; a new subscription starts the reader again
                self.held.clear()  # removals may come while it is down: nothing is claimed
                self._engine_sequence = None
                for queue in list(self._subscribers):
                    self._subscribers.discard(queue)
                    self._end(queue)
