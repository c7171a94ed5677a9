"""Loading a model whose worker dies at start: the operator reads the cause."""

from __future__ import annotations

import sys
from pathlib import Path

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


async def test_each_replica_starts_on_its_share_of_the_models_gpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker processes themselves see their share as CUDA_VISIBLE_DEVICES, its
    indices counting the GPUs the control plane sees, and NCCL's settings of the control
    plane's environment reach them."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "10,11,12,13,14,15,16,17")  # an allocation
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    seen = tmp_path / "seen"
    seen.mkdir()
    replicas = 2

    def records(*args: object, **kwargs: object) -> list[str]:
        """A worker that writes what it sees, waits (30 s at most) until every replica has,
        so that none is stopped before it writes, and dies."""
        name = Path(str(args[4])).name  # its termination log's: the worker's name and port
        script = (
            "import os, pathlib, time; e = os.environ; "
            f"d = pathlib.Path({str(seen)!r}); "
            f"(d / {name!r}).write_text("
            "e.get('CUDA_VISIBLE_DEVICES', '-') + ' ' + e.get('NCCL_NVLS_ENABLE', '-')); "
            "end = time.monotonic() + 30\n"
            f"while len(list(d.iterdir())) < {replicas} and time.monotonic() < end: "
            "time.sleep(0.01)\n"
            "raise SystemExit(3)"
        )
        return [sys.executable, "-c", script]

    monkeypatch.setattr(lifecycle, "worker_command", records)
    loader = ModelLoader(ModelRegistry(), "127.0.0.1")
    try:
        placed = ModelSpec(
            name="placed",
            engine="vllm",
            model="builtin:tiny",
            replicas=2,
            gpus=("4", "6", "5", "GPU-5f1c0a7e"),
        )
        with pytest.raises(StartupError):
            await loader.load(placed)
        assert sorted(p.read_text() for p in seen.iterdir()) == ["14,16 0", "15,GPU-5f1c0a7e 0"]
        for p in seen.iterdir():
            p.unlink()
        replicas = 1
        with pytest.raises(StartupError):  # no gpus: what the control plane sees
            await loader.load(ModelSpec(name="anywhere", engine="vllm", model="builtin:tiny"))
        assert [p.read_text() for p in seen.iterdir()] == ["10,11,12,13,14,15,16,17 0"]
        for p in seen.iterdir():
            p.unlink()
        beyond = ModelSpec(name="beyond", engine="vllm", model="builtin:tiny", gpus=("8",))
        with pytest.raises(StartupError) as err:
            await loader.load(beyond)
        assert "gpus: GPU 8 is not among the 8 this control plane sees" in str(err.value)
        assert not list(seen.iterdir())  # refused before any worker started
    finally:
        await loader.stop_all()
