"""Keep the last lines written to this process's stderr, its children's included.

vLLM starts its engine core in a child process; when that child fails to start, the
parent's exception only says "see root cause above": the reason (a KV cache too small
for `max_model_len`, say) was logged by the child. `StderrTail` puts a pipe behind file
descriptor 2 before the child is started, so the child inherits it, and one thread
copies everything through to the real stderr while it keeps the last lines for
`engine_failure()`. Once the engine is built (or has failed), `detach()` gives this
process its real stderr back; the thread runs on for the children, which write to the
pipe for as long as they live.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from collections import deque

MAX_LINES = 400
_PARENT_SAYS = "Engine core initialization failed"  # vLLM's own line: "see root cause above"
_EXCEPTION_LINE = re.compile(r"^(?:[\w.]+\.)?(\w*(?:Error|Exception)): (.+)$")


class StderrTail:
    def __init__(self, max_lines: int = MAX_LINES) -> None:
        self._lines: deque[str] = deque(maxlen=max_lines)
        self._lock = threading.Lock()
        self._partial = b""
        sys.stderr.flush()
        self._real = os.dup(2)
        read_end, write_end = os.pipe()
        os.dup2(write_end, 2)
        os.close(write_end)
        self._read_end = read_end
        self._thread = threading.Thread(target=self._pump, name="stderr-tail", daemon=True)
        self._thread.start()

    def detach(self) -> None:
        """Point this process's own stderr back at the real one (once its children are
        started: they keep the pipe, and `engine_failure()` still reads them). What this
        process writes from now on cannot be lost in the pipe when it exits."""
        sys.stderr.flush()
        os.dup2(self._real, 2)

    def _pump(self) -> None:
        try:
            while True:
                try:
                    chunk = os.read(self._read_end, 65536)
                except OSError:
                    return
                if not chunk:
                    return
                try:
                    os.write(self._real, chunk)
                except OSError:
                    pass  # the real stderr is gone; keep the lines anyway
                self._keep(chunk)
        finally:
            # Should this thread ever stop, nothing of ours may block on a full pipe.
            self.detach()

    def _keep(self, chunk: bytes) -> None:
        *complete, self._partial = (self._partial + chunk).split(b"\n")
        if len(self._partial) > 65536:
            complete.append(self._partial)
            self._partial = b""
        with self._lock:
            self._lines.extend(line.decode(errors="replace") for line in complete)

    def lines(self) -> list[str]:
        with self._lock:
            return list(self._lines)

    def engine_failure(self, wait_s: float = 2.0) -> str | None:
        """The last exception line a child wrote ("ValueError: To serve ..."), or None.

        The child's last words may still be in the pipe when the parent hears of its
        failure, so this looks again for up to `wait_s`."""
        deadline = time.monotonic() + wait_s
        while True:
            for line in reversed(self.lines()):
                match = _EXCEPTION_LINE.match(line.strip())
                if match and _PARENT_SAYS not in match.group(2):
                    return f"{match.group(1)}: {match.group(2)}"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)
