"""`switchyard serve` with no config: the embedded tiny model on a vLLM worker that the
control plane starts, supervises and stops."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from control.supervisor import free_port
from tests.procs import start_process, wait_serving

pytestmark = pytest.mark.engine


def test_serve_embedded_default(tmp_path: Path) -> None:
    port = free_port()
    proc = start_process(
        ["-m", "control", "serve", "--listen", f"127.0.0.1:{port}"], port, tmp_path, "serve"
    )
    try:
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
