from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Histogram

from control.metrics import BATCH_OBSERVATIONS, ITL_BUCKETS, BatchedHistogram, flush_batched


def samples(registry: CollectorRegistry) -> dict[str, float]:
    return {
        f"{s.name}{sorted(s.labels.items())}": s.value
        for family in registry.collect()
        for s in family.samples
    }


def pair() -> tuple[CollectorRegistry, Histogram, CollectorRegistry, Histogram]:
    plain_registry, batched_registry = CollectorRegistry(), CollectorRegistry()
    plain = Histogram("itl", "x", ["model"], buckets=ITL_BUCKETS, registry=plain_registry)
    batched = Histogram("itl", "x", ["model"], buckets=ITL_BUCKETS, registry=batched_registry)
    return plain_registry, plain, batched_registry, batched


def test_a_flushed_batch_reads_as_the_same_observations_one_by_one() -> None:
    plain_registry, plain, batched_registry, batched = pair()
    batch = BatchedHistogram.of(batched.labels("m"), ITL_BUCKETS)
    rng = random.Random(3)
    # Values on the bounds themselves land in that bucket (`le` is inclusive).
    values = [*ITL_BUCKETS, 0.0, 1e9, *(rng.expovariate(20) for _ in range(300))]
    for v in values:
        plain.labels("m").observe(v)
        batch.observe(v)
    assert samples(batched_registry)["itl_count[('model', 'm')]"] == 0  # not yet
    flush_batched()
    assert samples(batched_registry) == samples(plain_registry)
    flush_batched()  # nothing new: nothing changes
    assert samples(batched_registry) == samples(plain_registry)


def test_a_full_batch_is_handed_on_without_waiting_for_the_flush() -> None:
    _, _, batched_registry, batched = pair()
    batch = BatchedHistogram.of(batched.labels("m"), ITL_BUCKETS)
    for _ in range(BATCH_OBSERVATIONS):
        batch.observe(0.02)
    got = samples(batched_registry)
    assert got["itl_count[('model', 'm')]"] == BATCH_OBSERVATIONS
    assert got["itl_bucket[('le', '0.025'), ('model', 'm')]"] == BATCH_OBSERVATIONS
    assert got["itl_bucket[('le', '0.01'), ('model', 'm')]"] == 0


def test_one_batch_per_histogram_child() -> None:
    _, _, _, batched = pair()
    assert BatchedHistogram.of(batched.labels("m"), ITL_BUCKETS) is BatchedHistogram.of(
        batched.labels("m"), ITL_BUCKETS
    )
    assert BatchedHistogram.of(batched.labels("n"), ITL_BUCKETS) is not BatchedHistogram.of(
        batched.labels("m"), ITL_BUCKETS
    )
