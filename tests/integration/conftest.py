"""Real processes started once per session, for the tests that start processes.

A vLLM engine costs about 30 s to start on this machine, so one worker process serves
the whole session; the control plane joins it as a remote worker by address.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

from control.fleet.local_workers import free_port
from switchyard_common.tinymodel import ensure_tiny_model
from tests.procs import SIM_MODEL, Proc, serving_control, start_process, wait_serving

# A failed test shows what its processes logged last, and the lines around each error in
# them (an engine's own traceback, say), so that a failure seen only in CI can be read.
LOG_TAIL_LINES = 40
ERROR_MARKS = ("Traceback", "Error", "error", "Killed", "core dumped")


def _procs_of(value: Any) -> Iterator[Proc]:
    if isinstance(value, Proc):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _procs_of(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _procs_of(v)
    elif isinstance(getattr(value, "proc", None), Proc):
        yield value.proc


def log_excerpt(proc: Proc) -> str:
    """The lines of `proc`'s log that say what went wrong: the first error's context
    and the log's end."""
    try:
        lines = proc.log_path.read_text(errors="replace").splitlines()
    except OSError as e:
        return f"(no log: {e})"
    first = next((i for i, line in enumerate(lines) if any(m in line for m in ERROR_MARKS)), None)
    parts: list[str] = []
    if first is not None and first < len(lines) - LOG_TAIL_LINES:
        parts += [f"... first error at line {first + 1}:", *lines[first : first + LOG_TAIL_LINES]]
    parts += [f"... the last {LOG_TAIL_LINES} of {len(lines)} lines:", *lines[-LOG_TAIL_LINES:]]
    return "\n".join(line[:400] for line in parts)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Any, Any]:
    report = yield
    if report.failed and call.when in ("setup", "call"):
        seen: set[int] = set()
        for value in getattr(item, "funcargs", {}).values():
            for proc in _procs_of(value):
                if id(proc) not in seen:
                    seen.add(id(proc))
                    report.sections.append(
                        (f"log of {proc.name} ({proc.log_path})", log_excerpt(proc))
                    )
    return report


@pytest.fixture(scope="session")
def worker(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    """One real vLLM worker (pyworker) on the tiny model, for the whole session."""
    port = free_port()
    proc = start_process(
        ["-m", "pyworker", "--model", str(tiny_model_dir), "--port", str(port)],
        port,
        tmp_path_factory.mktemp("worker"),
        "pyworker",
    )
    try:
        wait_serving(proc)
        yield proc
    finally:
        code = proc.stop()
        assert code == 0, f"worker exited with {code} on SIGTERM:\n{proc.log_tail()}"


def _tiny_control(worker: Proc, tmp: Path, settings: str, name: str) -> Iterator[Proc]:
    models = (
        "  - name: tiny\n"
        "    engine: vllm\n"
        f"    model: {ensure_tiny_model()}\n"
        f"    workers: [{worker.address}]\n"
    )
    with serving_control(tmp, models, "tiny", settings=settings, name=name) as p:
        yield p


@pytest.fixture(scope="session")
def control(worker: Proc, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    """The control plane in front of the session's worker, serving it as model 'tiny', on
    its default front (the native one: this build has it)."""
    yield from _tiny_control(worker, tmp_path_factory.mktemp("control"), "", "control")


@pytest.fixture(scope="session")
def aio_control(worker: Proc, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    """`control` on the grpc.aio front (api.front: python), in front of the same worker."""
    tmp = tmp_path_factory.mktemp("aio-control")
    yield from _tiny_control(worker, tmp, "api: {front: python}\n", "aio")


@pytest.fixture(scope="module")
def vllm_and_sim(
    worker: Proc, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Proc]:
    """A control plane per test module serving the session's vLLM worker as 'tiny' and a
    simulator model as 'sim', to hold one behaviour to both engines."""
    models = (
        f"  - {{name: tiny, engine: vllm, model: {tiny_model_dir}, workers: [{worker.address}]}}\n"
        + SIM_MODEL
    )
    tmp = tmp_path_factory.mktemp("vllm-and-sim")
    with serving_control(tmp, models, "tiny", "sim", timeout=120) as proc:
        yield proc
