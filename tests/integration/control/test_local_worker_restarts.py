"""A local worker that keeps dying (a real process, /bin/false) is restarted with backoff, then
given up on (the worker command lines: tests/unit/control/fleet/test_supervisor.py)."""

from __future__ import annotations


async def test_local_worker_restarts_with_backoff_then_gives_up() -> None:
    import asyncio

    from control.fleet.local_workers import LocalWorker

    lw = LocalWorker("dies", ["/bin/false"], "127.0.0.1:1", backoff_s=(0.05, 0.1))
    await lw.start()
    for _ in range(200):
        if lw.gave_up:
            break
        await asyncio.sleep(0.02)
    assert lw.gave_up and lw.status == "gave_up"
    assert lw.restarts == 2  # two restarts, then the third death is final
    await lw.stop()
