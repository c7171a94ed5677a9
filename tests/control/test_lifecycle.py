"""Loading a model whose worker dies at start: the operator reads the cause."""

from __future__ import annotations

import sys

import pytest

from control.config import ModelSpec
from control.fleet import lifecycle
from control.fleet.lifecycle import ModelLoader, StartupError
from control.fleet.models import ModelRegistry


async def test_a_worker_that_dies_at_start_is_named_not_wrapped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def dies(*args: object, **kwargs: object) -> list[str]:
        return [sys.executable, "-c", "raise SystemExit(3)"]

    monkeypatch.setattr(lifecycle, "worker_command", dies)
    loader = ModelLoader(ModelRegistry(), "127.0.0.1")
    spec = ModelSpec(name="doomed", engine="vllm", model="builtin:tiny", replicas=2)
    with pytest.raises(StartupError) as err:
        await loader.load(spec)
    message = str(err.value)
    assert "ExceptionGroup" not in message and "TaskGroup" not in message
    assert "exited with code 3 before it was ready" in message
    assert "doomed" in message
    await loader.stop_all()
