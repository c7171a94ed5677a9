"""Real processes for tests: start one, wait until its health says SERVING, stop it.
The same primitives the benchmark uses (bench/systems.py)."""

from __future__ import annotations

import sys
from pathlib import Path

from bench.systems import Proc, start, wait_grpc_serving

STARTUP_TIMEOUT_S = 300.0

__all__ = ["Proc", "start_process", "wait_serving"]


def wait_serving(proc: Proc, service: str = "", timeout: float = STARTUP_TIMEOUT_S) -> None:
    wait_grpc_serving(proc, proc.address, service, timeout)


def start_process(
    args: list[str], port: int, log_dir: Path, name: str, executable: str = sys.executable
) -> Proc:
    """Start `executable args` (default: this Python) with its output in log_dir/name.log."""
    return start(name, [executable, *args], log_dir, f"127.0.0.1:{port}", log_level="info")
