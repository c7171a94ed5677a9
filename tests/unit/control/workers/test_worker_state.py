"""A worker's state (control/workers/state.py): each counter's invariant, kept by the
methods that change it."""

from __future__ import annotations

from control.workers.state import Load, WorkerInfo, WorkerState


class Call:
    adapter = ""

    def __init__(self) -> None:
        self.ejected = False

    def eject(self) -> None:
        self.ejected = True


def test_a_call_is_counted_in_flight_once_and_released_once() -> None:
    w = WorkerState("w:1")
    a, b = Call(), Call()
    w.begin_call(a, cost_tokens=30, prompt_tokens=10)
    w.begin_call(b, cost_tokens=5, prompt_tokens=4)
    assert (w.in_flight, w.in_flight_tokens, w.prefill_tokens) == (2, 35, 14)
    w.prefilled(10)  # a's first message
    w.end_call(a, 30, 0)
    w.end_call(a, 30, 0)  # a second release changes nothing
    assert (w.in_flight, w.in_flight_tokens, w.prefill_tokens) == (1, 5, 4)
    w.end_call(b, 5, 4)  # ended before its first message
    assert (w.in_flight, w.in_flight_tokens, w.prefill_tokens, w.calls) == (0, 0, 0, set())


def test_ejecting_fails_every_call_in_flight() -> None:
    w = WorkerState("w:1")
    calls = [Call(), Call()]
    for c in calls:
        w.begin_call(c, 1, 0)
    assert w.eject_calls() == 2 and all(c.ejected for c in calls)


def test_a_worker_that_stops_serving_holds_no_adapters() -> None:
    w = WorkerState("w:1")
    w.info = WorkerInfo("sim", "1", "m", 64, 512, (1,), 16)
    w.set_serving(True)
    w.adapters.add("sql")
    assert w.healthy and w.state() == "closed"
    w.set_serving(False)
    assert not w.adapters and not w.healthy and w.state() == "not_serving"


def test_a_load_report_remembers_what_was_in_flight_when_it_came() -> None:
    w = WorkerState("w:1")
    w.begin_call(Call(), 1, 0)
    w.report_load(Load(running=3, waiting=1))
    w.begin_call(Call(), 1, 0)
    assert (w.running, w.waiting, w.in_flight_at_report, w.in_flight) == (3, 1, 1, 2)
