"""switchyard_runtime: the C++ executor interface and simulator, driven from Python."""

from __future__ import annotations

import datetime

import pytest
import switchyard_runtime as rt


def config(**kw: object) -> rt.SimConfig:
    c = rt.SimConfig()
    c.vocab_size = 1000
    c.max_context = 1024
    c.decode_step_us = 200
    for k, v in kw.items():
        setattr(c, k, v)
    return c


def drain(sim: rt.SimExecutor, timeout_s: float = 5.0) -> dict[int, list[rt.GenResponse]]:
    got: dict[int, list[rt.GenResponse]] = {}
    finals = 0
    waited = 0.0
    while waited < timeout_s:
        batch = sim.await_responses(datetime.timedelta(milliseconds=50))
        waited += 0.05 if not batch else 0
        for r in batch:
            got.setdefault(r.id, []).append(r)
            finals += r.is_final
        if finals and all(rs[-1].is_final for rs in got.values()):
            break
    return got


def test_real_time_simulator_streams_predictable_tokens() -> None:
    sim = rt.SimExecutor(config())
    prompt = [5, 6, 7]
    rid = sim.enqueue(rt.GenRequest(prompt, 12, seed=3))
    responses = drain(sim)[rid]
    tokens = [t for r in responses for t in r.tokens]
    h = rt.SimExecutor.hash_tokens(prompt)
    assert tokens == [rt.SimExecutor.token_at(h, 3, i, 1000) for i in range(12)]
    final = responses[-1]
    assert final.is_final and final.finish == rt.FinishReason.LENGTH
    assert final.prompt_tokens == 3
    assert sim.info().engine == "sim"
    sim.shutdown()
    assert not sim.can_enqueue()


def test_cancel_and_stats_through_the_interface() -> None:
    sim = rt.SimExecutor(config(decode_step_us=2000))
    executor: rt.Executor = sim  # the interface the worker programs against
    rid = executor.enqueue(rt.GenRequest([1, 2], 500))
    executor.await_responses(datetime.timedelta(milliseconds=50))
    stats = executor.latest_stats()
    assert stats is not None and stats.active_requests == 1 and stats.kv_blocks_used > 0
    executor.cancel(rid)
    finals = [r for rs in drain(sim).values() for r in rs if r.is_final]
    assert [f.finish for f in finals] == [rt.FinishReason.CANCELLED]
    after = executor.latest_stats()
    assert after is not None and after.active_requests == 0
    executor.shutdown()


def test_virtual_clock_and_invalid_requests() -> None:
    sim = rt.SimExecutor(config(virtual_clock=True, prefill_us_per_token=10))
    sim.enqueue(rt.GenRequest([1] * 100, 2))
    assert sim.step() == pytest.approx(100 * 10 + 200 + 20)
    assert sim.now_us() > 0
    with pytest.raises(ValueError, match="prompt_token_ids"):
        sim.enqueue(rt.GenRequest([], 4))
    with pytest.raises(ValueError, match="max_tokens"):
        sim.enqueue(rt.GenRequest([1], 5000))
