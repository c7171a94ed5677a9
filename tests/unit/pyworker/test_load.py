"""The worker's sliding-window token rate."""

from __future__ import annotations

import pytest

from pyworker.load import TokenRate


def test_rate_counts_tokens_in_the_window() -> None:
    rate = TokenRate(window_s=2.0, bucket_s=0.1)
    rate.add(10, now=100.0)
    rate.add(30, now=100.55)
    assert rate.rate(now=101.0) == pytest.approx(20.0)


def test_old_tokens_leave_the_window() -> None:
    rate = TokenRate(window_s=1.0, bucket_s=0.1)
    rate.add(50, now=10.01)
    rate.add(5, now=10.95)
    assert rate.rate(now=11.0) == pytest.approx(55.0)  # [10.0, 10.1) still overlaps
    assert rate.rate(now=11.15) == pytest.approx(5.0)
    assert rate.rate(now=20.0) == 0.0


def test_nothing_generated_is_zero() -> None:
    rate = TokenRate()
    rate.add(0)
    assert rate.rate() == 0.0
