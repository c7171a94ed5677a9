"""Where the benchmarks' results go: raw data under results/AREA/ (JSON, compressed with xz
when the name ends in `.xz`), and the generated pages, with their figures, under
docs/results/. Each page names the command that made it and the commit it ran at.
"""

from __future__ import annotations

import json
import lzma
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RAW = ROOT / "results"  # raw data, out of the reading path
PAGES = ROOT / "docs" / "results"  # the generated pages and their PNGs


def write_json(path: Path, data: Any) -> None:
    """Write results as JSON; xz-compressed when the name ends in `.xz`."""
    text = json.dumps(data, indent=1) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".xz":
        path.write_bytes(lzma.compress(text.encode()))
    else:
        path.write_text(text)


def read_json(path: Path) -> Any:
    """A results file: JSON, or JSON compressed with xz (`.json.xz`, as the runs kept under
    results/ are)."""
    if path.suffix == ".xz":
        return json.loads(lzma.decompress(path.read_bytes()))
    return json.loads(path.read_text())


def commit() -> str:
    """The checkout's commit (short), with "+changes" when its tree differs from it."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT, capture_output=True, text=True, timeout=30, check=True,
        ).stdout.strip()  # fmt: skip
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT, capture_output=True, text=True, timeout=30,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+changes" if dirty else "")


def relative(path: Path) -> str:
    """`path` as the repository names it (for a page to cite), else as given."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)
