"""Real processes for tests: start one, wait until its health says SERVING, stop it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

STARTUP_TIMEOUT_S = 300.0


@dataclass
class Proc:
    address: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self, n: int = 60) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def stop(self, timeout: float = 30.0) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        return self.popen.returncode


def wait_serving(proc: Proc, service: str = "", timeout: float = STARTUP_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(proc.address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            if proc.popen.poll() is not None:
                raise RuntimeError(
                    f"process exited with {proc.popen.returncode}:\n{proc.log_tail()}"
                )
            try:
                r = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.5)
    raise TimeoutError(f"{proc.address} not SERVING after {timeout} s:\n{proc.log_tail()}")


def start_process(
    args: list[str], port: int, log_dir: Path, name: str, executable: str = sys.executable
) -> Proc:
    """Start `executable args` (default: this Python) with its output in log_dir/name.log."""
    log_path = log_dir / f"{name}.log"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", SWITCHYARD_LOG_LEVEL="info")
    with open(log_path, "wb") as log:
        popen = subprocess.Popen([executable, *args], stdout=log, stderr=subprocess.STDOUT, env=env)
    return Proc(f"127.0.0.1:{port}", popen, log_path)
