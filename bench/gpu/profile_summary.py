"""Where a process's time goes, from py-spy's collapsed stacks (`py-spy record --format raw`).

    python -m bench.gpu.profile_summary PROFILE.txt [--top 25]

Prints, for the busiest functions, the share of samples in which each was on the stack
(inclusive) and at the top of it (self), and the share of samples in which the process
was idle (waiting in the event loop's selector, or in a thread's wait). The tables in
docs/results/profiles.md come from this.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

_FRAME = re.compile(r"^(?P<func>.+?) \((?P<file>[^:()]+)(?::\d+)?\)$")
# Frames that mean "waiting": an event loop selecting, a thread blocked on a lock.
IDLE = ("select (selectors.py", "_run_once", "wait (threading.py", "poll (")


def _name(frame: str) -> str:
    m = _FRAME.match(frame.strip())
    if not m:
        return frame.strip()
    path = m.group("file")
    for marker in ("site-packages/", "lib/python3.11/"):
        if marker in path:
            path = path.split(marker, 1)[1]
    return f"{m.group('func')} ({path})"


def summarize(text: str) -> tuple[int, Counter[str], Counter[str], int]:
    """(samples, inclusive counts, self counts, idle samples) of a collapsed profile."""
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    total = idle = 0
    for line in text.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [f for f in stack.split(";") if f and not f.startswith(("process ", "thread "))]
        if not frames:
            continue
        total += count
        top = frames[-1]
        if any(top.startswith(marker) for marker in IDLE) and "select" in top:
            idle += count
            continue
        names = [_name(f) for f in frames]
        for name in set(names):
            inclusive[name] += count
        own[names[-1]] += count
    return total, inclusive, own, idle


def table(path: Path, top: int = 25) -> str:
    total, inclusive, own, idle = summarize(path.read_text(errors="replace"))
    if not total:
        return f"{path}: no samples\n"
    lines = [
        f"{path.name}: {total} samples, idle (waiting in the event loop) {100 * idle / total:.0f}%",
        "",
        "| function | on stack | self |",
        "|---|---|---|",
    ]
    for name, count in inclusive.most_common(top):
        lines.append(f"| `{name}` | {100 * count / total:.1f}% | {100 * own[name] / total:.1f}% |")
    lines += ["", "| busiest leaf functions | self |", "|---|---|"]
    for name, count in own.most_common(top // 2):
        lines.append(f"| `{name}` | {100 * count / total:.1f}% |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("profiles", nargs="+", type=Path)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    for path in args.profiles:
        print(table(path, args.top))


if __name__ == "__main__":
    main()
