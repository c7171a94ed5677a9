"""pyworker/stderr_tail.py in a real process tree: what a child wrote to stderr before it died
is read back, and still reaches the real stderr."""

from __future__ import annotations

import subprocess
import sys


def test_stderr_tail_reads_what_a_child_said_before_it_died() -> None:
    child = "import sys; sys.stderr.write('Traceback...\\nValueError: KV cache too small\\n')"
    script = (
        "import subprocess, sys\n"
        "from pyworker.stderr_tail import StderrTail\n"
        "tail = StderrTail()\n"
        f"subprocess.run([sys.executable, '-c', {child!r}])\n"
        "sys.stderr.write('RuntimeError: Engine core initialization failed. See above.\\n')\n"
        "print('FOUND', tail.engine_failure())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert "FOUND ValueError: KV cache too small" in out.stdout
    assert "KV cache too small" in out.stderr  # and it still reached the real stderr
