"""Fixtures both halves use: the generated tiny model. The processes the integration tests
share (one vLLM worker, the control plane in front of it) are in tests/integration/conftest.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from switchyard_common.tinymodel import ensure_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    return ensure_tiny_model()
