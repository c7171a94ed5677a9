"""Tokenizers are built in threads (one per model at start-up); the first import of
`transformers` must not race."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

# A fresh interpreter each time: the race is in the first import of transformers.
_LOAD_IN_THREADS = """
import sys, threading
from control.text.tokenizer import Tokenizer
errors = []
def load():
    try:
        Tokenizer(sys.argv[1])
    except Exception as exc:
        errors.append(repr(exc))
threads = [threading.Thread(target=load) for _ in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(errors[0] if errors else "ok")
"""


def test_tokenizers_built_at_once_in_fresh_processes_all_load(tiny_model_dir: Path) -> None:
    for _ in range(3):
        out = subprocess.run(
            [sys.executable, "-c", _LOAD_IN_THREADS, str(tiny_model_dir)],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=120,
            check=False,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip().splitlines()[-1] == "ok", out.stdout
