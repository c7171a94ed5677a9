"""Fixtures for the vLLM worker tests.

The worker process itself is the session-wide `worker` fixture of tests/integration/conftest.py
(`python -m pyworker` on the tiny model, SERVING before the first test, SIGTERM and
exit code 0 checked at the end), so the whole suite shares one engine.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from switchyard.worker.v1 import worker_pb2_grpc


@pytest.fixture(scope="session")
def channel(worker: Any) -> Iterator[grpc.Channel]:
    """A channel to the session's worker."""
    with grpc.insecure_channel(worker.address) as ch:
        yield ch


@pytest.fixture(scope="session")
def stub(channel: grpc.Channel) -> Any:
    return worker_pb2_grpc.WorkerStub(channel)
