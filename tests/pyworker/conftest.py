"""A real vLLM worker process, shared by the whole session (an engine start costs ~40 s)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

STARTUP_TIMEOUT_S = 180.0
SHUTDOWN_TIMEOUT_S = 60.0
REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class WorkerProcess:
    proc: subprocess.Popen[bytes]
    address: str
    model: str
    log_path: Path

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "<no log>"
        return "\n".join(text.splitlines()[-lines:])


def start_worker(model: Path, log_path: Path, *extra_args: str) -> WorkerProcess:
    """Start `python -m pyworker` on a free port; its output goes to `log_path`."""
    port = free_port()
    log_file = log_path.open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pyworker", "--model", str(model), "--port", str(port), *extra_args],
        stdout=log_file,
        stderr=subprocess.STDOUT,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    log_file.close()  # the child holds its own descriptor
    return WorkerProcess(proc, f"127.0.0.1:{port}", str(model), log_path)


def wait_until_serving(worker: WorkerProcess, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    """Poll grpc.health.v1 until SERVING; fail early if the process exits."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(worker.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if worker.proc.poll() is not None:
                pytest.fail(
                    f"worker exited with {worker.proc.returncode} during startup:\n"
                    f"{worker.log_tail()}"
                )
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.5)
    pytest.fail(f"worker not SERVING after {timeout_s:.0f} s:\n{worker.log_tail()}")


def stop_worker(worker: WorkerProcess, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> int:
    """SIGTERM, wait, and return the exit code (SIGKILL if it does not exit in time)."""
    if worker.proc.poll() is None:
        worker.proc.send_signal(signal.SIGTERM)
    try:
        return worker.proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        worker.proc.kill()
        worker.proc.wait()
        raise


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    from control.tinymodel import ensure_tiny_model

    return ensure_tiny_model()


@pytest.fixture(scope="session")
def worker(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    log_path = tmp_path_factory.mktemp("pyworker") / "worker.log"
    started = time.monotonic()
    proc = start_worker(tiny_model, log_path, "--max-model-len", "2048")
    try:
        wait_until_serving(proc)
        sys.stderr.write(f"\npyworker SERVING after {time.monotonic() - started:.1f} s\n")
        yield proc
    finally:
        code = stop_worker(proc)
        assert code == 0, f"worker exited with {code}:\n{proc.log_tail()}"


@pytest.fixture(scope="session")
def channel(worker: WorkerProcess) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(worker.address) as ch:
        yield ch
