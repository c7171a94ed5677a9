"""`switchyard serve --listeners N`: N gRPC servers in one process on one port, each
accepting new calls on its own (grpc.aio accepts one call at a time per server). A knob of
the grpc.aio front (`api.front: python`); the native front accepts on grpc++'s threads.

What a user sees: the process listens N times on its port and serves every connection,
whichever listener the kernel hands it to; another `switchyard serve` on that port is
still refused with "port in use"; on SIGTERM every listener closes and the port is free.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from switchyard.v1 import generation_pb2, generation_pb2_grpc

from control.fleet.local_workers import free_port
from switchyard_common.ports import check_free
from tests.procs import Proc, start_process, wait_serving

ROOT = Path(__file__).resolve().parents[3]
LISTENERS = 4
MODEL = "  - {name: sim, engine: sim, model: builtin:tiny, engine_args: {decode_step_us: 1000}}\n"


def listening_sockets(port: int) -> int:
    """How many sockets listen on 127.0.0.1:port (state 0A in /proc/net/tcp, or tcp6,
    where gRPC's sockets show as IPv4-mapped addresses)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state = fields[1], fields[3]
            if state == "0A" and local.endswith(f"0100007F:{port:04X}"):
                count += 1
    return count


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Proc, int, Path]]:
    port = free_port()
    config = tmp_path / "c.yaml"
    config.write_text(f"listen: 127.0.0.1:{port}\napi: {{front: python}}\nmodels:\n{MODEL}")
    args = ["-m", "control", "serve", "--config", str(config), "--listeners", str(LISTENERS)]
    proc = start_process(args, port, tmp_path, "ctl")
    try:
        wait_serving(proc, "sim", timeout=120)
        yield proc, port, config
    finally:
        proc.stop()


async def _generate_on_own_connections(address: str, channels: int) -> list[int]:
    """One Generate per channel, each channel its own TCP connection, all at once: the
    tokens each got."""

    async def one(i: int) -> int:
        options = [("grpc.use_local_subchannel_pool", 1)]  # no connection shared
        async with grpc.aio.insecure_channel(address, options=options) as ch:
            req = generation_pb2.GenerateRequest(model="sim", text=f"hello {i}")
            req.stopping.max_tokens = 8
            req.stopping.ignore_eos = True
            got = 0
            async for msg in generation_pb2_grpc.GenerationStub(ch).Generate(req, timeout=60):
                got += len(msg.chunk.token_ids)
            return got

    return list(await asyncio.gather(*(one(i) for i in range(channels))))


def test_every_listener_serves_and_all_close_on_sigterm(
    served: tuple[Proc, int, Path],
) -> None:
    proc, port, _ = served
    assert listening_sockets(port) == LISTENERS
    # 32 connections over 4 listeners: the kernel gives each listener some of them
    assert asyncio.run(_generate_on_own_connections(proc.address, 32)) == [8] * 32
    assert proc.stop() == 0, proc.log_tail()
    assert listening_sockets(port) == 0
    check_free("127.0.0.1", port)  # nothing holds the port any more


def test_a_second_control_plane_on_the_port_is_refused(
    served: tuple[Proc, int, Path], tmp_path: Path
) -> None:
    """Both set SO_REUSEPORT for their own listeners; the second must still not join."""
    _, port, config = served
    out = subprocess.run(
        [sys.executable, "-m", "control", "serve", "--config", str(config)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 1, out.stderr[-2000:]
    assert f"127.0.0.1:{port}: port in use" in out.stderr
    assert listening_sockets(port) == LISTENERS  # the first one's, untouched
