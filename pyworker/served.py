"""A GenerateStream request that runs in a task of its own through `Generations.serve`:
a beam search, which answers once at the end and has no engine steps to batch (the
others go through `relay.StreamedRequest`). Same interface as StreamedRequest."""

from __future__ import annotations

import asyncio
from typing import Any

from pyworker.errors import StatusError
from pyworker.generations import Generations
from pyworker.load import InFlight
from pyworker.relay import EventSink
from pyworker.request import ParsedGenerate


class _Events:
    """`Generations.serve`'s sink, onto the session's events (none of which waits)."""

    blocking = False

    def __init__(self, sink: EventSink) -> None:
        self._sink = sink

    async def chunk(self, chunk: Any) -> None:
        self._sink.chunk(list(chunk.token_ids), None)

    async def final(self, final: Any) -> None:
        self._sink.final(final)

    async def time_limit(self, final: Any) -> None:
        self._sink.final(final)

    async def error(self, exc: StatusError) -> None:
        self._sink.error(exc)


class ServedRequest:
    """One admitted request, served by `Generations.serve` in the task that runs
    `start()`; `cancel()` cancels that task (serve aborts and releases it)."""

    def __init__(
        self,
        generations: Generations,
        parsed: ParsedGenerate,
        state: InFlight,
        sink: EventSink,
        arrived: float,
        deadline: float | None,
    ) -> None:
        self._generations = generations
        self._parsed = parsed
        self._state = state
        self._sink = sink
        self._arrived = arrived
        self._deadline = deadline
        self._task: asyncio.Task[Any] | None = None
        self._cancelled = False
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    @property
    def request_id(self) -> str:
        return self._state.request_id

    async def start(self) -> None:
        try:
            if self._cancelled:  # cancelled before this task ran: never reaches the engine
                self._generations.release(self._state)
                return
            self._task = asyncio.current_task()
            await self._generations.serve(
                self._parsed, self._state, _Events(self._sink), self._arrived, self._deadline
            )
        except asyncio.CancelledError:
            if not self._cancelled:
                raise
        finally:
            if not self.done.done():
                self.done.set_result(None)

    def cancel(self) -> None:
        self._cancelled = True
        if self._task is not None and not self.done.done():
            self._task.cancel()
