"""Admission per model: at most `max_concurrency` requests run, at most `max_queue` wait.

Beyond both, a request is refused at once with RESOURCE_EXHAUSTED and a retry delay, so
an overloaded model costs bounded memory. Waiting requests are served highest priority
first, then in arrival order. A waiter that is cancelled or times out leaves the queue.

The counts are kept in a `LimitState` (control/fleet/shared_limits.py): this process's
own by default; with `serve --routers N`, the whole service's, so the limits hold for
all N processes together. Then a newcomer runs at once only if a slot is free and nobody
waits in any process; each process keeps its own priority queue of waiters; a slot
released here goes to a waiter here first, else back to the service. While a process has
waiters, it looks every `poll_s` (a few milliseconds) for a slot that another process
freed; with none, it does nothing. Every slot taken is given back exactly once: by
`release`, and where a router process dies holding some, by its supervisor (`reclaim`).

`running` and `queued`, and the metrics `admission_running` and `admission_queue`, are
this process's: the supervisor's metrics endpoint sums the processes' gauges, which is
the service's count.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from dataclasses import dataclass, field

from control.errors import Overloaded
from control.fleet.shared_limits import Admit, LimitState, LocalLimits
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
        state: LimitState | None = None,
    ) -> None:
        self.model = model
        self.max_concurrency = max_concurrency
        self.max_queue = max_queue
        self.metrics = metrics or ModelMetrics(model)
        self._state: LimitState = state if state is not None else LocalLimits()
        self._running = 0  # slots this process holds
        self._queue: list[_Waiter] = []
        self._seq = itertools.count()
        self._poller: asyncio.Task[None] | None = None

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

    async def acquire(self, priority: int, timeout: float | None) -> None:
        """Wait for a slot. Raises Overloaded when the queue is full, TimeoutError after
        `timeout` seconds in the queue."""
        outcome, running, queued = self._state.admit(
            self.model, self.max_concurrency, self.max_queue
        )
        if outcome is Admit.RUN:
            self.running += 1
            return
        if outcome is Admit.FULL:
            self.metrics.rejections.inc()
            # A rough hint: more waiting means come back later; bounded to [0.05, 5] s.
            retry = min(5.0, 0.05 * (1 + queued + max(0, running - self.max_concurrency)))
            raise Overloaded(
                f"model {self.model!r} is overloaded: {running} running, "
                f"{queued} queued (limits {self.max_concurrency} and {self.max_queue})",
                retry,
            )
        waiter = _Waiter(-priority, next(self._seq), asyncio.get_running_loop().create_future())
        heapq.heappush(self._queue, waiter)
        self._queue_changed()
        if self._state.poll_s is not None and (self._poller is None or self._poller.done()):
            self._poller = asyncio.create_task(
                self._poll(self._state.poll_s), name=f"admission {self.model}"
            )
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
                self._state.leave_queue(self.model)
            raise

    def release(self) -> None:
        if self._queue:
            waiter = heapq.heappop(self._queue)  # never done: a waiter that gives up leaves
            self._queue_changed()
            self._state.hand_over(self.model)
            waiter.future.set_result(None)  # the slot passes on; running stays
            return
        self._state.release(self.model)
        self.running -= 1

    async def _poll(self, every_s: float) -> None:
        """While this process has waiters: give them the slots other processes free."""
        while self._queue:
            await asyncio.sleep(every_s)
            while self._queue and self._state.claim(self.model, self.max_concurrency):
                waiter = heapq.heappop(self._queue)
                self._queue_changed()
                self.running += 1
                waiter.future.set_result(None)
