"""The limits' shared state (control/fleet/shared_limits.py): two `SharedLimits` opened on
one file in this process, each with a pid of its own, stand for two router processes
(flock locks an open file, so the two exclude each other as processes would)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from control.api.auth import RateLimiter
from control.errors import Overloaded
from control.fleet.admission import Admission
from control.fleet.shared_limits import Admit, LimitState, LocalLimits, SharedLimits

DEADLINE_S = 5.0


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[SharedLimits, SharedLimits]]:
    first = SharedLimits.create(tmp_path)
    second = SharedLimits(first.path, pid=first.pid + 1)
    yield first, second
    second.close()
    first.remove()


@pytest.mark.parametrize("kind", ["local", "shared"])
def test_one_limiter_counts_the_same_in_either_state(kind: str, tmp_path: Path) -> None:
    """The sequence of tests/unit/control/api/test_auth.py, in both kinds of state."""
    state: LimitState = LocalLimits() if kind == "local" else SharedLimits.create(tmp_path)
    now = [100.0]
    limiter = RateLimiter(2, 100, clock=lambda: now[0], name="a", state=state)
    assert limiter.take_request() is None
    assert limiter.take_request() is None
    assert limiter.take_request() == pytest.approx(0.5)
    now[0] += 0.5
    assert limiter.take_request() is None
    assert limiter.take_tokens(150) is None
    assert limiter.take_tokens(1) == pytest.approx(0.5)
    limiter.give_back_tokens(60)
    assert limiter.take_tokens(1) is None


def test_buckets_are_shared_by_name_and_rates(pair: tuple[SharedLimits, SharedLimits]) -> None:
    a, b = pair
    now = [50.0]

    def limiter(state: SharedLimits, name: str = "team", rate: float = 1) -> RateLimiter:
        return RateLimiter(rate, 10, clock=lambda: now[0], name=name, state=state)

    here, there = limiter(a), limiter(b)
    assert here.take_request() is None
    assert there.take_request() == pytest.approx(1.0)  # the one request was taken here
    assert limiter(b, name="other").take_request() is None  # another token: its own
    assert limiter(b, rate=2).take_request() is None  # new rates (a reload): new buckets
    now[0] += 1.0
    assert there.take_request() is None
    assert here.take_request() is not None
    assert here.take_tokens(11) is None  # into debt
    assert there.take_tokens(1) == pytest.approx(0.1)  # for both
    there.give_back_tokens(5)
    assert here.take_tokens(5) is None  # what came back there is here
    assert there.take_tokens(1) == pytest.approx(0.1)


async def test_admission_counts_are_shared(pair: tuple[SharedLimits, SharedLimits]) -> None:
    a, b = pair
    here = Admission("m", max_concurrency=2, max_queue=1, state=a)
    there = Admission("m", max_concurrency=2, max_queue=1, state=b)
    other_model = Admission("n", max_concurrency=1, max_queue=0, state=b)
    await here.acquire(0, None)
    await there.acquire(0, None)
    await other_model.acquire(0, None)  # its own counts
    assert a.counts("m") == (2, 0) and a.counts("n") == (1, 0)
    waiting = asyncio.create_task(there.acquire(0, None))
    await asyncio.sleep(0)
    assert (there.queued, a.counts("m")) == (1, (2, 1))
    # The queue is full across both: refused here, with the service's counts.
    with pytest.raises(Overloaded, match=r"2 running, 1 queued \(limits 2 and 1\)") as e:
        await here.acquire(9, None)
    assert e.value.retry_after_s == pytest.approx(0.1)
    # A slot freed here, with nobody waiting here, goes to the waiter there.
    here.release()
    await asyncio.wait_for(waiting, DEADLINE_S)
    assert (here.running, there.running, b.counts("m")) == (0, 2, (2, 0))
    there.release()
    there.release()
    other_model.release()
    assert b.counts("m") == (0, 0) and b.counts("n") == (0, 0)


def test_a_newcomer_waits_while_another_process_has_waiters(
    pair: tuple[SharedLimits, SharedLimits],
) -> None:
    a, b = pair
    assert a.admit("m", 1, 5)[0] is Admit.RUN
    assert b.admit("m", 1, 5)[0] is Admit.QUEUE
    a.release("m")  # free, but someone waits there: a newcomer here queues behind
    assert a.admit("m", 1, 5) == (Admit.QUEUE, 0, 2)
    assert b.claim("m", 1) and not a.claim("m", 1)
    assert a.counts("m") == (1, 1)


async def test_timeouts_cancels_and_late_handovers_leave_the_counts_right(
    pair: tuple[SharedLimits, SharedLimits],
) -> None:
    a, b = pair
    here = Admission("m", max_concurrency=1, max_queue=5, state=a)
    there = Admission("m", max_concurrency=1, max_queue=5, state=b)
    await here.acquire(0, None)
    with pytest.raises(TimeoutError):
        await there.acquire(0, 0.01)
    task = asyncio.create_task(there.acquire(0, None))
    await asyncio.sleep(0)
    assert a.counts("m") == (1, 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert a.counts("m") == (1, 0)
    # Handed over here just as the waiter here gave up: the slot goes back, once.
    late = asyncio.create_task(here.acquire(0, None))
    await asyncio.sleep(0)
    here.release()  # hands the slot to `late`, which is cancelled before it runs
    late.cancel()
    with pytest.raises(asyncio.CancelledError):
        await late
    assert (here.running, here.queued, a.counts("m")) == (0, 0, (0, 0))


def test_the_share_of_a_dead_process_is_given_back(
    pair: tuple[SharedLimits, SharedLimits],
) -> None:
    a, b = pair
    assert b.admit("m", 2, 5)[0] is Admit.RUN
    assert b.admit("n", 1, 5)[0] is Admit.RUN
    assert b.admit("n", 1, 5)[0] is Admit.QUEUE
    assert a.admit("m", 2, 5)[0] is Admit.RUN
    assert a.reclaim(b.pid) == {"running": 2, "queued": 1}
    assert a.counts("m") == (1, 0) and a.counts("n") == (0, 0)
    assert a.reclaim(b.pid) == {"running": 0, "queued": 0}  # once
    # A new process of the same pid, where the death went unnoticed, starts clean.
    assert a.admit("m", 2, 5)[0] is Admit.RUN
    again = SharedLimits(a.path, pid=a.pid)
    assert again.counts("m") == (0, 0)
    again.close()


def test_operator_errors_name_the_file_and_why(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "limits"
    with pytest.raises(OSError, match=f"cannot open the shared limits file {missing}: No such"):
        SharedLimits(missing)
    other = tmp_path / "other"
    other.write_bytes(b"not a limits file")
    with pytest.raises(OSError, match=f"{other} is not one of this version"):
        SharedLimits(other)
    with pytest.raises(OSError, match=f"cannot create .* in {tmp_path / 'nowhere'}: No such"):
        SharedLimits.create(tmp_path / "nowhere")


def test_the_file_is_private(pair: tuple[SharedLimits, SharedLimits]) -> None:
    a, _ = pair
    assert os.stat(a.path).st_mode & 0o777 == 0o600
    assert os.stat(a.path.parent).st_mode & 0o777 == 0o700
