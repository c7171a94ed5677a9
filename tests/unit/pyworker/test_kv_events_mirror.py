"""The vLLM worker's reading of its engine's KV-cache events (`pyworker.kv_events`), from
messages shaped as vLLM's publisher sends them: what a new subscriber is told the engine
holds, and what a gap in the engine's sequence does to it. The publisher itself, on a
real engine, is in tests/integration/conformance/test_kv_events.py."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from control.routing.kv_index import KvIndex, prompt_keys
from pyworker.kv_events import SNAPSHOT_BLOCKS_PER_BATCH, TOPIC, KvEvents

BLOCK = 4


def frames(seq: int, *events: dict[str, Any]) -> list[bytes]:
    return [TOPIC, seq.to_bytes(8, "big"), msgspec.msgpack.encode([1.0, list(events), 0])]


def stored(hashes: list[int], parent: int | None, tokens: list[int]) -> dict[str, Any]:
    e: dict[str, Any] = {"type": "BlockStored", "block_hashes": hashes, "token_ids": tokens}
    e |= {"block_size": BLOCK, "lora_name": None}
    if parent is not None:
        e["parent_block_hash"] = parent
    return e


def index_of(batches: list[Any]) -> KvIndex:
    index = KvIndex()
    for batch in batches:
        if batch.reset:
            index.cleared("w")
        for event in batch.events:
            s = event.stored
            parent = s.parent_block_hash if s.HasField("parent_block_hash") else None
            assert index.stored("w", list(s.block_hashes), parent, list(s.token_ids), BLOCK)
    return index


def test_a_new_subscriber_is_told_every_held_block_after_its_parent() -> None:
    events = KvEvents("ipc:///nowhere")
    a, b = list(range(10, 18)), list(range(30, 34))
    events.handle(frames(0, stored([1, 2], None, a)))  # a prompt of two blocks
    events.handle(frames(1, stored([3], 2, b)))  # a third after them
    events.handle(frames(2, {"type": "BlockRemoved", "block_hashes": [1]}))
    # The first block came back after the others: a snapshot still sends it first.
    events.handle(frames(3, stored([1], None, a[:4])))
    snapshot = list(events.snapshot())
    assert snapshot[0].reset
    order = [e.stored.block_hashes[0] for batch in snapshot for e in batch.events]
    assert order == [1, 2, 3]
    index = index_of(snapshot)
    assert index.overlap(prompt_keys([*a, *b, 99], BLOCK), ["w"]) == {"w": 3}


def test_removed_and_cleared_blocks_are_not_announced_and_a_gap_forgets_all() -> None:
    events = KvEvents("ipc:///nowhere")
    events.handle(frames(0, stored([1, 2], None, list(range(8)))))
    events.handle(frames(1, {"type": "BlockRemoved", "block_hashes": [2]}))
    assert [e.stored.block_hashes[0] for e in next(events.snapshot()).events] == [1]
    events.handle(frames(2, {"type": "AllBlocksCleared"}))
    (empty,) = events.snapshot()  # the reset alone, and the end of the snapshot
    assert empty.reset and empty.snapshot_end and not empty.events
    events.handle(frames(3, stored([5], None, list(range(4)))))
    events.handle(frames(9, stored([6], None, list(range(4, 8)))))  # 4-8 were lost
    # What the lost events did is unknown: only what came after the gap is claimed.
    assert [e.stored.block_hashes[0] for e in next(events.snapshot()).events] == [6]


def test_a_large_cache_is_told_in_bounded_batches_and_the_stream_follows() -> None:
    events = KvEvents("ipc:///nowhere")
    n = SNAPSHOT_BLOCKS_PER_BATCH + 10
    tokens = [t % 400 + 4 for t in range(n * BLOCK)]
    events.handle(frames(0, stored(list(range(1, n + 1)), None, tokens)))

    async def first_batches() -> list[Any]:
        got = []
        stream = events.subscribe()
        got.append(await anext(stream))
        got.append(await anext(stream))
        events.handle(frames(1, {"type": "BlockRemoved", "block_hashes": [n]}))
        got.append(await anext(stream))  # what happened after the subscription
        await stream.aclose()
        return got

    snapshot_1, snapshot_2, after = asyncio.run(first_batches())
    assert snapshot_1.reset and not snapshot_2.reset
    # The end of what the engine held is marked, and only there.
    assert [b.snapshot_end for b in (snapshot_1, snapshot_2, after)] == [False, True, False]
    assert len(snapshot_1.events) == SNAPSHOT_BLOCKS_PER_BATCH and len(snapshot_2.events) == 10
    assert snapshot_1.sequence == snapshot_2.sequence < after.sequence
    assert list(after.events[0].removed.block_hashes) == [n]
    index = index_of([snapshot_1, snapshot_2])
    assert index.overlap(prompt_keys(tokens, BLOCK), ["w"]) == {"w": n}
