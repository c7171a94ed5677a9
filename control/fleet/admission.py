"""Admission per model: at most `max_concurrency` requests run, at most `max_queue` wait.

Beyond both, a request is refused at once with RESOURCE_EXHAUSTED and a retry delay, so
an overloaded model costs bounded memory. Waiting requests are served highest priority
first, then in arrival order. A waiter that is cancelled or times out leaves the queue.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from dataclasses import dataclass, field

from control.errors import Overloaded
from control.metrics import ModelMetrics


@dataclass(order=True)
class _Waiter:
    priority: int  # negated: heapq pops the smallest
    seq: int
    future: asyncio.Future[None] = field(compare=False)


class Admission:
    def __init__(
        self,
        model: str,
        max_concurrency: int,
        max_queue: int,
        metrics: ModelMetrics | None = None,
    ) -> None:
        self.model = model
        self.max_concurrency = max_concurrency
        self.max_queue = max_queue
        self.metrics = metrics or ModelMetrics(model)
        self._running = 0
        self._queue: list[_Waiter] = []
        self._seq = itertools.count()

    @property
    def running(self) -> int:
        return self._running

    @running.setter
    def running(self, value: int) -> None:
        self._running = value
        self.metrics.admission_running.set(value)

    def _queue_changed(self) -> None:
        self.metrics.admission_queue.set(len(self._queue))

    @property
    def queued(self) -> int:
        return len(self._queue)

    def retry_after_s(self) -> float:
        # A rough hint: more waiting means come back later; bounded to [0.05, 5] s.
        return min(5.0, 0.05 * (1 + self.queued + max(0, self.running - self.max_concurrency)))

    async def acquire(self, priority: int, timeout: float | None) -> None:
        """Wait for a slot. Raises Overloaded when the queue is full, TimeoutError after
        `timeout` seconds in the queue."""
        if self.running < self.max_concurrency and not self._queue:
            self.running += 1
            return
        if len(self._queue) >= self.max_queue:
            self.metrics.rejections.inc()
            raise Overloaded(
                f"model {self.model!r} is overloaded: {self.running} running, "
                f"{len(self._queue)} queued (limits {self.max_concurrency} and {self.max_queue})",
                self.retry_after_s(),
            )
        waiter = _Waiter(-priority, next(self._seq), asyncio.get_running_loop().create_future())
        heapq.heappush(self._queue, waiter)
        self._queue_changed()
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future), timeout)
        except BaseException:
            if waiter.future.done() and not waiter.future.cancelled():
                self.release()  # the slot was handed over just as we gave up: pass it on
            else:
                waiter.future.cancel()
                self._queue.remove(waiter)
                heapq.heapify(self._queue)
                self._queue_changed()
            raise

    def release(self) -> None:
        while self._queue:
            waiter = heapq.heappop(self._queue)
            self._queue_changed()
            if not waiter.future.done():
                waiter.future.set_result(None)  # the slot passes on; running stays
                return
        self.running -= 1
