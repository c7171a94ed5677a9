"""Local worker processes: start them, wait until they serve, restart them when they die,
and stop them (SIGTERM, a grace period, then SIGKILL)."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import structlog

from control.config import ModelSpec
from control.text.tokenizer import Tokenizer

log = structlog.get_logger(__name__)

RESTART_BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0)


_HANDED_OUT: collections.deque[int] = collections.deque(maxlen=4096)
_HANDED_OUT_LOCK = threading.Lock()


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, and one this process has not handed out before: the
    kernel may offer the same free port twice in a row, and a worker started on the first
    has not bound it yet when the second is asked for."""
    with _HANDED_OUT_LOCK:
        for _ in range(256):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((host, 0))
                port: int = s.getsockname()[1]
            if port not in _HANDED_OUT:
                _HANDED_OUT.append(port)
                return port
    raise OSError(f"no free port on {host} that this process has not handed out already")


def termination_log_path(name: str, port: int) -> Path:
    """Where local worker `name` writes why it could not start (like Kubernetes'
    terminationMessagePath); unique per control plane, worker and port."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", name)  # model names may hold "/"
    return Path(tempfile.gettempdir()) / f"switchyard-{os.getpid()}-{safe}-{port}.termination"


def cpp_worker_binary() -> str:
    """The C++ worker installed beside this Python (pip install . builds it)."""
    beside = Path(sys.executable).parent / "switchyard-cpp-worker"
    found = str(beside) if beside.exists() else shutil.which("switchyard-cpp-worker")
    if not found:
        raise FileNotFoundError(
            "switchyard-cpp-worker is not installed; build with SWITCHYARD_BUILD_CPP=ON"
        )
    return found


def worker_command(
    spec: ModelSpec,
    model_path: str,
    port: int,
    tokenizer: Tokenizer | None = None,
    termination_log: Path | None = None,
    otlp_endpoint: str | None = None,
) -> list[str]:
    """The command line of one local worker for `spec`.

    The vLLM worker takes its engine arguments as one JSON object, types kept, and
    checks them against the vLLM it runs. A sim worker takes its vocabulary and EOS id
    from the model's tokenizer unless the config sets them, so that the text it streams
    decodes. A TensorRT-LLM worker reads its limits from the engine's config.json and
    its EOS ids from the tokenizer's generation_config.json (a lone `eos_id` from the
    tokenizer would drop the others, as Llama 3 has); it is given the tokenizer's
    directory and vocabulary to check against the engine. A worker that cannot start
    writes why to `termination_log`.
    """
    args = dict(spec.engine_args)
    if spec.engine == "vllm":
        if otlp_endpoint is not None:  # vLLM's own spans continue the control plane's
            args.setdefault("otlp_traces_endpoint", otlp_endpoint)
        cmd = [sys.executable, "-m", "pyworker", "--model", model_path, "--port", str(port)]
        if args:
            cmd += ["--engine-args", json.dumps(args, sort_keys=True)]
        if termination_log is not None:
            cmd += ["--termination-log", str(termination_log)]
        return cmd
    else:
        cmd = [cpp_worker_binary(), "--engine", spec.engine, "--model", model_path]
        if tokenizer is not None:
            args.setdefault("vocab_size", tokenizer.vocab_size)
            if spec.engine == "sim" and tokenizer.eos_token_id is not None:
                args.setdefault("eos_id", tokenizer.eos_token_id)
        if spec.engine == "trtllm":
            args.setdefault("tokenizer", spec.tokenizer or model_path)
        if spec.engine == "sim":
            args = {f"sim_{k}": v for k, v in args.items()}
        if termination_log is not None:
            args["termination_log"] = str(termination_log)
    cmd += ["--port", str(port)]
    for key, value in sorted(args.items()):
        if isinstance(value, bool):
            value = int(value)
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    return cmd


class LocalWorker:
    """One worker process, restarted with backoff while the supervisor runs."""

    def __init__(
        self,
        name: str,
        cmd: Sequence[str],
        address: str,
        backoff_s: Sequence[float] = RESTART_BACKOFF_S,
        stable_s: float = 60.0,
        termination_log: Path | None = None,
        env: Mapping[str, str] | None = None,
        on_exit: Callable[[int], None] | None = None,
    ) -> None:
        self.name = name
        self.env = dict(env) if env is not None else None  # None: this process's
        self._visible = (self.env if self.env is not None else os.environ).get(
            "CUDA_VISIBLE_DEVICES", ""
        )
        self.on_exit = on_exit  # called with the pid of each process that ended
        self.termination_log = termination_log  # where the worker writes why it could not start
        self.cmd = list(cmd)
        self.address = address
        self.backoff_s = tuple(backoff_s)
        self.stable_s = stable_s  # a run this long forgives earlier failures
        self.proc: asyncio.subprocess.Process | None = None
        self.gave_up = False
        self.restarts = 0
        self._restarting = False
        self._started_at = 0.0
        self._stopping = False
        self._monitor: asyncio.Task[None] | None = None

    @property
    def gpus(self) -> list[str]:
        """The GPUs it is started on: its CUDA_VISIBLE_DEVICES (empty where unset)."""
        return [g.strip() for g in self._visible.split(",") if g.strip()]

    @property
    def status(self) -> str:
        if self.gave_up:
            return "gave_up"
        if self._restarting:
            return "restarting"
        if self._stopping:
            return "stopped"
        return "running"

    async def start(self) -> None:
        log.info("starting worker", worker=self.name, address=self.address)
        self._started_at = time.monotonic()
        if self.termination_log is not None:
            self.termination_log.unlink(missing_ok=True)
        self.proc = await asyncio.create_subprocess_exec(*self.cmd, env=self.env)
        if self._monitor is None:
            self._monitor = asyncio.create_task(self._watch(), name=f"watch {self.name}")

    def termination_message(self) -> str | None:
        """What the worker wrote before it exited, if it wrote anything."""
        if self.termination_log is None:
            return None
        try:
            text = self.termination_log.read_text(errors="replace").strip()
        except OSError:
            return None
        return text or None

    @property
    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.returncode

    async def _watch(self) -> None:
        failures = 0
        while not self._stopping:
            assert self.proc is not None
            code = await self.proc.wait()
            if self.on_exit is not None:
                self.on_exit(self.proc.pid)
            if self._stopping:
                return
            if time.monotonic() - self._started_at >= self.stable_s:
                failures = 0
            failures += 1
            if failures > len(self.backoff_s):
                log.error(
                    "worker keeps dying; giving up",
                    worker=self.name,
                    exit_code=code,
                    failures=failures,
                )
                self.gave_up = True
                return
            delay = self.backoff_s[failures - 1]
            log.error("worker exited", worker=self.name, exit_code=code, restart_in_s=delay)
            self._restarting = True
            await asyncio.sleep(delay)
            self._restarting = False
            if not self._stopping:
                self.restarts += 1
                await self.start()

    async def stop(self, grace: float = 15.0) -> None:
        self._stopping = True
        if self._monitor is not None:
            self._monitor.cancel()
            # Wait for it to end; a cancellation of our own caller still propagates.
            await asyncio.gather(self._monitor, return_exceptions=True)
        if self.termination_log is not None:
            self.termination_log.unlink(missing_ok=True)
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), grace)
        except TimeoutError:
            log.warning("worker did not stop in time; killing", worker=self.name)
            proc.kill()
            await proc.wait()
        log.info("worker stopped", worker=self.name, exit_code=proc.returncode)
