"""Real processes for tests: start one, wait until its health says SERVING, stop it (the same
primitives the benchmark uses, bench/systems.py); and `serving_control`, the control plane
with simulator workers (or any others) that the integration tests share."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc

from bench.systems import Proc, start, wait_grpc_serving
from control.fleet.local_workers import free_port

STARTUP_TIMEOUT_S = 300.0

__all__ = ["SIM_MODEL", "Proc", "serving_control", "start_process", "wait_serving", "worker_pid"]


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


# One simulated model, "sim": a C++ worker on its simulator, which the control plane starts
# and stops itself.
SIM_MODEL = "  - {name: sim, engine: sim, model: builtin:tiny}\n"


@contextlib.contextmanager
def serving_control(
    log_dir: Path,
    models_yaml: str = SIM_MODEL,
    *models: str,
    settings: str = "",
    extra_args: Sequence[str] = (),
    port: int | None = None,
    name: str = "ctl",
    timeout: float = STARTUP_TIMEOUT_S,
    credentials: grpc.ChannelCredentials | None = None,
) -> Iterator[Proc]:
    """The control plane with simulator workers (or any others): `switchyard serve` on
    127.0.0.1:port (a free port unless given), its config `listen:`, then `settings` (top-level
    YAML lines: api, auth, tls, metrics ...), then `models:` with `models_yaml` (the list's
    lines; by default one simulated model, "sim"); `extra_args` follow `--config`. Up once
    every one of `models` serves (none named: once the server's health says SERVING), over
    `credentials` where it serves TLS; log and config in log_dir/name.*; stopped cleanly
    (exit 0 on SIGTERM) after."""
    port = free_port() if port is None else port
    config = log_dir / f"{name}.yaml"
    config.write_text(f"listen: 127.0.0.1:{port}\n{settings}models:\n{models_yaml}")
    argv = ["-m", "control", "serve", "--config", str(config), *extra_args]
    proc = start_process(argv, port, log_dir, name)
    try:
        for model in models or ("",):
            wait_serving(proc, model, timeout=timeout, credentials=credentials)
        yield proc
    finally:
        code = proc.stop()
        assert code == 0, f"control plane exited with {code} on SIGTERM:\n{proc.log_tail()}"


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
