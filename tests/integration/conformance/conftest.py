"""Both workers, one suite: the vLLM worker (pyworker) and the C++ worker on its simulator.

Every test in this folder takes `any_worker`, which runs it once per worker.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from control.fleet.local_workers import cpp_worker_binary, free_port
from tests.procs import Proc, start_process, wait_serving

# The simulator set up like the tiny model: same vocabulary, context and EOS id, and slow
# enough (2 ms a step) that a long generation can be cancelled or time out mid-stream.
SIM_ARGS = [
    "--sim-vocab-size",
    "512",
    "--sim-max-context",
    "2048",
    "--sim-eos-id",
    "1",
    "--sim-decode-step-us",
    "2000",
]


def start_cpp_worker(tmp: Path, name: str = "cpp-worker") -> Proc:
    port = free_port()
    proc = start_process(
        ["--engine", "sim", "--model", "sim-tiny", "--port", str(port), *SIM_ARGS],
        port,
        tmp,
        name,
        executable=cpp_worker_binary(),
    )
    wait_serving(proc, timeout=30)
    return proc


@pytest.fixture(scope="session")
def cpp_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    proc = start_cpp_worker(tmp_path_factory.mktemp("cpp"))
    try:
        yield proc
    finally:
        code = proc.stop()
        assert code == 0, f"C++ worker exited with {code} on SIGTERM:\n{proc.log_tail()}"


@pytest.fixture(params=["vllm", "sim"], scope="session")
def engine(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="session")
def any_worker(engine: str, request: pytest.FixtureRequest) -> Proc:
    name = "worker" if engine == "vllm" else "cpp_worker"
    proc: Proc = request.getfixturevalue(name)
    return proc
