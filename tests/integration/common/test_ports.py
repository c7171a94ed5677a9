"""A server started on a port another process serves fails at start with "port in use"
instead of sharing the port (gRPC's default SO_REUSEPORT)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from switchyard_common.ports import NO_REUSEPORT, bind, check_free

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def listening() -> Iterator[int]:
    """A port served by a gRPC server with gRPC's defaults (SO_REUSEPORT on), as an
    earlier worker started without the fix would hold it."""
    from concurrent import futures

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield port
    finally:
        server.stop(None)


async def test_a_second_grpc_server_on_a_port_fails_with_port_in_use() -> None:
    first = grpc.aio.server(options=[NO_REUSEPORT])
    port = bind(first, "127.0.0.1:0")
    await first.start()
    try:
        second = grpc.aio.server(options=[NO_REUSEPORT])
        with pytest.raises(OSError, match="port in use"):
            bind(second, f"127.0.0.1:{port}")
    finally:
        await first.stop(None)


def test_check_free_names_the_address(listening: int) -> None:
    with pytest.raises(OSError, match=rf"127\.0\.0\.1:{listening}: port in use"):
        check_free("127.0.0.1", listening)
    check_free("127.0.0.1", 0)


def run_until_exit(argv: list[str], timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False
    )


def test_the_vllm_worker_refuses_a_port_in_use_before_loading_its_engine(
    listening: int, tiny_model_dir: Path
) -> None:
    out = run_until_exit(
        [sys.executable, "-m", "pyworker", "--model", str(tiny_model_dir), "--port", str(listening)]
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"127.0.0.1:{listening}: port in use" in out.stderr


def test_the_control_plane_refuses_a_port_in_use(listening: int, tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(
        f"listen: 127.0.0.1:{listening}\n"
        "models:\n  - {name: sim, engine: sim, model: builtin:tiny}\n"
    )
    out = run_until_exit([sys.executable, "-m", "control", "serve", "--config", str(config)])
    assert out.returncode == 1, out.stderr[-2000:]
    assert f"127.0.0.1:{listening}: port in use" in out.stderr
