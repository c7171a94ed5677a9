"""A worker's health as the control plane follows it: `grpc.health.v1` Watch, the load
reports of `StreamLoad`, and a canary (a one-token generation every interval) that ejects
a worker whose process lives but whose engine hangs, moving its streams elsewhere.

Each runs as a task of its `WorkerClient` (`start_watching`) until the client closes,
and writes what it learns into the worker's state (control.workers.state).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import grpc
import structlog
from grpc_health.v1 import health_pb2
from switchyard.worker.v1 import worker_pb2

from control.workers.state import Load, WorkerState

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class HealthPolicy:
    canary_interval_s: float = 5.0
    canary_timeout_s: float = 2.0
    failure_threshold: int = 3


Outcome = Literal["ok", "queued", "failed"]


def progressing(worker: WorkerState, since: float) -> bool:
    """The worker reported, after `since`, that its engine is generating: a canary that
    timed out behind a full queue then says the worker is busy, not hung. A hung engine
    reports no tokens once the worker's rate window (2 s) has passed; a stopped process
    reports nothing."""
    load = worker.load
    return load.updated > since and load.generation_tokens_per_s > 0


async def canary(worker: WorkerState, stub: Any, policy: HealthPolicy) -> None:
    """A one-token generation every interval: a worker whose process lives but whose
    engine hangs stops answering it, and its circuit opens. A canary that waits its
    timeout out (or is refused as over capacity) behind other requests while the engine
    generates counts neither way: a saturated worker is not ejected."""
    while True:
        await asyncio.sleep(policy.canary_interval_s)
        if not worker.serving or worker.info is None:
            continue
        started = time.monotonic()
        outcome = await probe(worker, stub, policy.canary_timeout_s)
        if outcome == "queued" and progressing(worker, started):
            log.debug(
                "canary queued behind load",
                worker=worker.address,
                waiting=worker.load.waiting,
                tokens_per_s=round(worker.load.generation_tokens_per_s),
            )
        elif outcome == "ok":
            if not worker.breaker.allows_traffic():
                log.info("worker canary passed; circuit closed", worker=worker.address)
            worker.breaker.record_success()
        else:
            worker.breaker.record_failure()
            # However the circuit opened (canaries, or requests that failed), streams on
            # a worker that does not answer its canary would hang with it: move them.
            if not worker.breaker.allows_traffic() and worker.calls:
                moved = worker.eject_calls()
                log.warning(
                    "worker ejected: canary failing", worker=worker.address, streams_moved=moved
                )


async def probe(worker: WorkerState, stub: Any, timeout: float) -> Outcome:
    """One canary: "ok" when it finished, "queued" when it ran out of time or the
    worker refused it as over capacity, "failed" otherwise."""
    assert worker.info is not None
    first = worker.info.eos_token_ids[0] if worker.info.eos_token_ids else 0
    req = worker_pb2.GenerateRequest(
        request_id=f"canary-{uuid.uuid4().hex[:12]}",
        prompt_token_ids=[first],
        max_tokens=1,
        ignore_eos=True,
    )
    started = time.monotonic()
    try:
        async for resp in stub.Generate(req, timeout=timeout):
            if resp.HasField("final"):
                worker.last_canary_ms = (time.monotonic() - started) * 1000
                return "ok"
    except grpc.aio.AioRpcError as e:
        busy = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED)
        return "queued" if e.code() in busy else "failed"
    return "failed"


async def watch_health(worker: WorkerState, health_stub: Any) -> None:
    backoff = 0.2
    while True:
        try:
            call = health_stub.Watch(health_pb2.HealthCheckRequest(service=""))
            async for resp in call:
                serving = resp.status == health_pb2.HealthCheckResponse.SERVING
                if serving != worker.serving:
                    log.info("worker health", worker=worker.address, serving=serving)
                worker.set_serving(serving)
                backoff = 0.2
        except grpc.aio.AioRpcError as e:
            if worker.serving:
                log.warning("worker unreachable", worker=worker.address, code=e.code().name)
            worker.set_serving(False)
        await asyncio.sleep(backoff)
        backoff = min(backoff * 2, 5.0)


KV_RESUBSCRIBE_S = 1.0


async def watch_kv_events(worker: WorkerState, stub: Any) -> None:
    """Feed the worker's KV-cache events to its model's index (`worker.kv_sink`), where
    its GetInfo says it has them. A reset, a broken stream or the end of following clear
    what the index holds for the worker: it never keeps blocks it may have missed the
    removal of."""
    while True:
        sink = worker.kv_sink
        if worker.info is None or not worker.info.kv_events:
            await asyncio.sleep(KV_RESUBSCRIBE_S)
            continue
        if sink is None:  # its model gives it one as it loads: subscribe then, at once
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(worker.kv_sink_set.wait(), KV_RESUBSCRIBE_S)
            continue
        address = worker.address
        try:
            call = stub.SubscribeKvEvents(worker_pb2.SubscribeKvEventsRequest())
            first: int | None = None  # the sequence the snapshot's batches carry
            async for batch in call:
                first = batch.sequence if first is None else first
                if batch.reset:
                    sink.cleared(address)
                for event in batch.events:
                    kind = event.WhichOneof("kind")
                    if kind == "stored":
                        s = event.stored
                        parent = s.parent_block_hash if s.HasField("parent_block_hash") else None
                        # A block whose parent is unknown here (the engine evicted the
                        # parent, or events were lost) is skipped by the index.
                        sink.stored(address, s.block_hashes, parent, s.token_ids, s.block_size,
                                    s.adapter)  # fmt: skip
                    elif kind == "removed":
                        sink.removed(address, event.removed.block_hashes)
                    elif kind == "cleared":
                        sink.cleared(address)
                # The end of what the engine held, as the worker marks it; a live batch
                # (a later sequence) also says so, from a worker that does not mark it.
                if batch.snapshot_end or batch.sequence != first:
                    worker.kv_synced.set()
        except grpc.aio.AioRpcError as e:
            log.info("kv events stream ended", worker=address, code=e.code().name)
        except Exception:  # a fault of ours or a closed channel: this task goes on
            log.warning("kv events stream failed", worker=address, exc_info=True)
        finally:
            worker.kv_synced.clear()
            sink.cleared(address)  # also when cancelled: nothing stale stays behind
        await asyncio.sleep(KV_RESUBSCRIBE_S)


async def wait_kv_synced(workers: Sequence[WorkerState], timeout_s: float) -> list[str]:
    """Waits, at most `timeout_s`, until the KV-cache events of every worker that reports
    them have reached its sink: its subscription's snapshot, what the engine holds, to the
    batch that ends it (a cache over 1,024 blocks takes several). So a model that has just
    loaded, in a control plane that restarted, does not route its first requests blind.
    Returns the addresses still waiting."""
    waiting = [w for w in workers if w.kv_sink is not None and w.info and w.info.kv_events]
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(
            asyncio.gather(*(w.kv_synced.wait() for w in waiting)), max(timeout_s, 0.0)
        )
    return [w.address for w in waiting if not w.kv_synced.is_set()]


async def watch_load(worker: WorkerState, stub: Any) -> None:
    while True:
        try:
            call = stub.StreamLoad(worker_pb2.StreamLoadRequest(interval_ms=250))
            async for r in call:
                load = Load(
                    r.running,
                    r.waiting,
                    r.kv_cache_usage,
                    time.monotonic(),
                    kv_blocks_used=r.kv_blocks_used,
                    kv_blocks_free=r.kv_blocks_free,
                    gpu_memory_used_bytes=r.gpu_memory_used_bytes,
                    generation_tokens_per_s=r.generation_tokens_per_s,
                )
                worker.report_load(load)
        except grpc.aio.AioRpcError:
            pass
        await asyncio.sleep(1.0)
