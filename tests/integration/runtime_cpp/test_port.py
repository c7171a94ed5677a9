"""The C++ worker refuses a port another process serves, instead of sharing it.

gRPC servers set SO_REUSEPORT by default: a worker started on a port that an earlier one
(with gRPC's defaults) serves would listen too, and the kernel would split connections
between them. The worker turns it off and exits at start with "port in use".
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from control.fleet.local_workers import cpp_worker_binary


@pytest.fixture
def served_port() -> Iterator[int]:
    """A port held by a gRPC server with gRPC's defaults (SO_REUSEPORT on)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield port
    finally:
        server.stop(None)


def test_the_cpp_worker_refuses_a_port_in_use(served_port: int) -> None:
    argv = [cpp_worker_binary(), "--engine", "sim", "--port", str(served_port)]
    try:
        # A worker that binds serves until stopped; one that cannot exits at once.
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the worker shared port {served_port} instead of exiting: {exc.stderr!r}")
    assert out.returncode != 0
    assert f"127.0.0.1:{served_port}: port in use" in out.stderr, out.stderr[-2000:]
