"""`switchyard serve` with no config: the embedded tiny model on a vLLM worker that the
control plane starts, supervises and stops."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from switchyard.v1 import generation_pb2, generation_pb2_grpc

from control.fleet.local_workers import free_port
from tests.procs import start_process, wait_serving

pytestmark = pytest.mark.engine


def test_serve_embedded_default(tmp_path: Path) -> None:
    port = free_port()
    proc = start_process(
        ["-m", "control", "serve", "--listen", f"127.0.0.1:{port}"], port, tmp_path, "serve"
    )
    try:
        # While the engine starts, the port answers: NOT_SERVING, and requests hear
        # UNAVAILABLE ("still loading"), not NOT_FOUND.
        with grpc.insecure_channel(proc.address) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            status = None
            for _ in range(100):
                try:
                    check = health_pb2.HealthCheckRequest(service="tiny")
                    status = health.Check(check, timeout=1).status
                    break
                except grpc.RpcError:
                    time.sleep(0.1)
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING
            stub = generation_pb2_grpc.GenerationStub(ch)
            with pytest.raises(grpc.RpcError) as info:
                stub.Complete(generation_pb2.GenerateRequest(model="tiny", text="Hi"), timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
            assert "loading" in info.value.details()  # type: ignore[attr-defined]
        wait_serving(proc, "tiny")
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "control",
                "generate",
                "--address",
                proc.address,
                "--max-tokens",
                "5",
                "--ignore-eos",
                "Hello",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert out.returncode == 0, out.stderr
        assert "[LENGTH] 5 tokens" in out.stderr
        assert "vllm" in out.stderr
    finally:
        code = proc.stop(timeout=60)
    log = proc.log_path.read_text()
    assert code == 0, log[-3000:]
    match = re.search(r"starting worker\s.*address=(\S+)", log)
    assert match, "the control plane did not log the worker it started"
    host, _, wport = match.group(1).rpartition(":")
    with socket.socket() as s:
        assert s.connect_ex((host, int(wport))) != 0, "worker still listening after shutdown"
    assert "worker stopped" in log
