"""The control plane reaching its workers over mutual TLS (`models[].worker_tls`), and
the workers' TLS flags."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from switchyard.v1 import generation_pb2, generation_pb2_grpc
from switchyard.worker.v1 import worker_pb2, worker_pb2_grpc

from control.fleet.local_workers import cpp_worker_binary, free_port
from switchyard_common.tinymodel import ensure_tiny_model
from tests.pki import make_pki
from tests.procs import start_process, wait_serving


def test_the_control_plane_reaches_a_worker_over_mutual_tls(tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    client_cert, client_key = tmp_path / "client.pem", tmp_path / "client.key"
    client_cert.write_bytes(pki.client_cert)
    client_key.write_bytes(pki.client_key)
    wport = free_port()
    worker = start_process(
        [
            "--engine", "sim", "--model", "tiny", "--port", str(wport),
            "--sim-vocab-size", "512", "--sim-eos-id", "1",
            "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
            "--tls-client-ca", str(pki.ca_file),
        ],
        wport, tmp_path, "worker", executable=cpp_worker_binary(),
    )  # fmt: skip
    ctl = None
    try:
        mtls = grpc.ssl_channel_credentials(pki.ca, pki.client_key, pki.client_cert)
        wait_serving(worker, timeout=60, credentials=mtls)
        # Plaintext, or TLS without the client certificate: no way in.
        for channel in (
            grpc.insecure_channel(worker.address),
            grpc.secure_channel(worker.address, grpc.ssl_channel_credentials(pki.ca)),
        ):
            with channel, pytest.raises(grpc.RpcError) as err:
                worker_pb2_grpc.WorkerStub(channel).GetInfo(worker_pb2.GetInfoRequest(), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        port = free_port()
        config = tmp_path / "ctl.yaml"
        config.write_text(
            f"listen: 127.0.0.1:{port}\nmodels:\n"
            "  - name: sim\n    engine: sim\n"
            f"    model: builtin:tiny\n    workers: [{worker.address}]\n"
            f"    worker_tls: {{ca: {pki.ca_file}, cert: {client_cert}, key: {client_key}, "
            "server_name: localhost}\n"
        )
        ctl = start_process(
            ["-m", "control", "serve", "--config", str(config)], port, tmp_path, "ctl"
        )
        wait_serving(ctl, "sim", timeout=60)
        with grpc.insecure_channel(ctl.address) as ch:
            out = generation_pb2_grpc.GenerationStub(ch).Complete(
                generation_pb2.GenerateRequest(
                    model="sim",
                    text="Hello",
                    stopping=generation_pb2.StoppingParams(max_tokens=4, ignore_eos=True),
                ),
                timeout=30,
            )
        assert out.final.usage.completion_tokens == 4
        assert out.final.worker == worker.address
    finally:
        if ctl is not None:
            assert ctl.stop() == 0, ctl.log_tail()
        assert worker.stop() == 0, worker.log_tail()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tls-cert", "/no/cert.pem"], "--tls-cert and --tls-key go together"),
        (["--tls-cert", "/no/cert.pem", "--tls-key", "/no/key"], "cannot read /no/"),
    ],
)
def test_the_vllm_worker_checks_its_tls_flags_before_its_engine(
    flags: list[str], message: str, tmp_path: Path
) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pyworker", "--model", str(ensure_tiny_model()),
         "--port", str(free_port()), *flags],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode == 2
    assert message in out.stderr


def test_the_cpp_worker_checks_its_tls_flags(tmp_path: Path) -> None:
    out = subprocess.run(
        [cpp_worker_binary(), "--engine", "sim", "--port", str(free_port()),
         "--tls-cert", "/no/cert.pem", "--tls-key", "/no/key.pem"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode == 2
    assert "--tls-key: cannot read /no/key.pem" in out.stderr
