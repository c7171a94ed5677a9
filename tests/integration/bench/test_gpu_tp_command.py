"""`python -m bench.gpu.tp --summary` on a result file, as a process (the readings and the
summary themselves: tests/unit/bench/test_gpu_tp.py)."""

from __future__ import annotations

import json
from pathlib import Path


def test_the_summary_reads_a_result_file(tmp_path: Path) -> None:
    import subprocess
    import sys

    path = tmp_path / "tp.json"
    path.write_text(json.dumps({"systems": [{"label": "tp2", "error": "boom"}]}))
    out = subprocess.run(
        [sys.executable, "-m", "bench.gpu.tp", "--summary", str(path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "- tp2: did not serve: boom" in out.stdout
