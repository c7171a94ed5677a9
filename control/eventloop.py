"""The event loop every Switchyard Python process runs on."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run_event_loop(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` on uvloop when it is installed (as vLLM's own servers do: its callbacks
    and futures cost less per message, which shows in time to first token), else on
    asyncio's loop. SWITCHYARD_EVENT_LOOP=asyncio forces the latter."""
    if os.environ.get("SWITCHYARD_EVENT_LOOP", "uvloop") != "asyncio":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                return runner.run(coro)
    return asyncio.run(coro)
