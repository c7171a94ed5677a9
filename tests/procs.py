"""Real processes for tests: start one, wait until its health says SERVING, stop it.
The same primitives the benchmark uses (bench/systems.py)."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc

from bench.systems import Proc, start, wait_grpc_serving

STARTUP_TIMEOUT_S = 300.0

__all__ = ["Proc", "serving_control", "start_process", "wait_serving", "worker_pid"]


def wait_serving(
    proc: Proc,
    service: str = "",
    timeout: float = STARTUP_TIMEOUT_S,
    credentials: grpc.ChannelCredentials | None = None,
) -> None:
    wait_grpc_serving(proc, proc.address, service, timeout, credentials)


def start_process(
    args: list[str], port: int, log_dir: Path, name: str, executable: str = sys.executable
) -> Proc:
    """Start `executable args` (default: this Python) with its output in log_dir/name.log."""
    return start(name, [executable, *args], log_dir, f"127.0.0.1:{port}", log_level="info")


@contextlib.contextmanager
def serving_control(
    log_dir: Path, port: int, models_yaml: str, *models: str, timeout: float = STARTUP_TIMEOUT_S
) -> Iterator[Proc]:
    """`switchyard serve` on 127.0.0.1:port with `models:` from `models_yaml` (the list's
    lines), up once every one of `models` serves; stopped cleanly (exit 0) after."""
    config = log_dir / "switchyard.yaml"
    config.write_text(f"listen: 127.0.0.1:{port}\nmodels:\n{models_yaml}")
    proc = start_process(["-m", "control", "serve", "--config", str(config)], port, log_dir, "ctl")
    try:
        for model in models:
            wait_serving(proc, model, timeout=timeout)
        yield proc
    finally:
        assert proc.stop() == 0, proc.log_tail()


def serve_startup_failure(config: Path, timeout: float = 280.0) -> str:
    """Run `switchyard serve --config config`, which must fail to start (exit 1), and
    return its last "startup failed" line: what the operator reads."""
    import subprocess

    out = subprocess.run(
        [sys.executable, "-m", "control", "serve", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert out.returncode == 1, out.stderr[-3000:]
    failed = [line for line in out.stderr.splitlines() if "startup failed" in line]
    assert failed, out.stderr[-3000:]
    return failed[-1]


def worker_pid(address: str) -> int:
    """The pid of the local C++ worker listening on `address`."""
    port = address.rpartition(":")[2]
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if cmd and cmd[0].endswith(b"switchyard-cpp-worker") and port.encode() in cmd:
            return int(pid)
    raise LookupError(f"no worker process for {address}")
