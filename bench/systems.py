"""The systems under test, each started by the benchmark itself on loopback.

Every system runs vLLM for the CPU on the same generated tiny model with the same engine
settings; only one engine runs at a time (this machine has two cores).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from control.fleet.local_workers import cpp_worker_binary, free_port

log = structlog.get_logger(__name__)

# The engine settings every system gets, as vLLM's AsyncEngineArgs names them.
ENGINE_SETTINGS: dict[str, Any] = {
    "max_model_len": 2048,
    "max_num_batched_tokens": 16384,
    "dtype": "float32",
}


def vllm_flags(settings: dict[str, Any]) -> list[str]:
    """The same settings as vLLM's own servers take them on their command line."""
    flags: list[str] = []
    for key, value in settings.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False:
            flags.append("--no-" + key.replace("_", "-"))
        else:
            flags += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return flags


START_TIMEOUT_S = 300.0


@dataclass
class Proc:
    """A process started by a benchmark or a test, with its output in a log file."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    address: str = ""

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, then SIGKILL after `timeout`; returns the exit code."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        return self.popen.returncode

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])


# `python -m MODULE ARGS` from the working directory's packages, even where this checkout
# is installed editable (its import hook would otherwise win over the directory).
_FROM_CHECKOUT = (
    "import runpy, sys; "
    "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in "
    "getattr(f, '__module__', type(f).__module__)]; "
    "sys.path.insert(0, ''); module = sys.argv[1]; sys.argv = [module, *sys.argv[2:]]; "
    "runpy.run_module(module, run_name='__main__', alter_sys=True)"
)


def start(
    name: str,
    argv: list[str],
    log_dir: Path,
    address: str = "",
    log_level: str = "warning",
    cwd: Path | None = None,
) -> Proc:
    """Start a process with its output in log_dir/NAME.log; `cwd` is where `python -m`
    finds its packages (another checkout, for a before-and-after comparison)."""
    log_path = log_dir / f"{name}.log"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", SWITCHYARD_LOG_LEVEL=log_level)
    if cwd is not None and argv[1:2] == ["-m"]:
        argv = [argv[0], "-c", _FROM_CHECKOUT, *argv[2:]]
    with open(log_path, "wb") as out:
        popen = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    log.debug("started", system=name, pid=popen.pid)
    return Proc(name, popen, log_path, address)


def wait_grpc_serving(
    proc: Proc,
    address: str,
    service: str = "",
    timeout: float = START_TIMEOUT_S,
    credentials: grpc.ChannelCredentials | None = None,
) -> float:
    """Seconds until `address` answers grpc.health SERVING for `service` (over TLS with
    `credentials`)."""
    started = time.monotonic()
    channel = (
        grpc.insecure_channel(address)
        if credentials is None
        else grpc.secure_channel(address, credentials)
    )
    with channel as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() - started < timeout:
            if proc.popen.poll() is not None:
                raise RuntimeError(
                    f"{proc.name} exited with {proc.popen.returncode}:\n{proc.log_tail()}"
                )
            with contextlib.suppress(grpc.RpcError):
                r = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return time.monotonic() - started
            time.sleep(0.25)
    raise TimeoutError(f"{proc.name} not SERVING after {timeout} s:\n{proc.log_tail()}")


def wait_http_ok(proc: Proc, url: str) -> float:
    import httpx

    started = time.monotonic()
    while time.monotonic() - started < START_TIMEOUT_S:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited:\n{proc.log_tail()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return time.monotonic() - started
        time.sleep(0.25)
    raise TimeoutError(f"{proc.name} not ready at {url}:\n{proc.log_tail()}")


@dataclass(frozen=True)
class Running:
    """A started server: where it listens, and its process (for CPU accounting)."""

    address: str
    pid: int


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (vLLM's engine core and model runner, for example)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def process_env(pid: int, names: tuple[str, ...]) -> dict[str, str] | None:
    """The values of `names` in a running process's environment, as it was started. A
    process that renames itself (vLLM's, through setproctitle) blanks it, unless
    SPT_NOENV is set in its environment. None: the process is gone."""
    with contextlib.suppress(OSError):
        raw = Path(f"/proc/{pid}/environ").read_bytes()
        pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
        env = {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}
        return {n: env[n] for n in names if n in env}
    return None  # gone


def cpu_seconds(pids: list[int]) -> float:
    """User plus system CPU time of the processes (all their threads) so far."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def rss_mb(proc: Proc) -> float:
    for line in Path(f"/proc/{proc.popen.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


@contextlib.contextmanager
def control_plane(
    model_yaml: str,
    log_dir: Path,
    name: str = "control",
    routers: int = 1,
    cwd: Path | None = None,
    listeners: int = 0,
    settings: str = "",
) -> Iterator[tuple[str, Proc]]:
    """Switchyard's control plane with the given models (YAML list items), in `routers`
    processes on one port (from the checkout in `cwd`, if given), each with `listeners`
    gRPC servers (0: its default); `settings`: top-level YAML lines (`api: ...`)."""
    port = free_port()
    config = log_dir / f"{name}.yaml"
    config.write_text(f"listen: 127.0.0.1:{port}\n{settings}models:\n{model_yaml}")
    argv = [sys.executable, "-m", "control", "serve", "--config", str(config.resolve())]
    argv += ["--routers", str(routers)] + (["--listeners", str(listeners)] if listeners else [])
    proc = start(name, argv, log_dir, cwd=cwd)
    try:
        wait_grpc_serving(proc, f"127.0.0.1:{port}", "")
        yield f"127.0.0.1:{port}", proc
    finally:
        proc.stop()


def remote_model(
    name: str, model: Path, worker: str, limits: int = 4096, worker_stream: bool = True
) -> str:
    return (
        f"  - name: {name}\n    engine: vllm\n    model: {model}\n    workers: [{worker}]\n"
        f"    limits: {{max_concurrency: {limits}, max_queue: {limits}}}\n"
        f"    worker_stream: {str(worker_stream).lower()}\n"
    )


@contextlib.contextmanager
def _server(name: str, argv: list[str], log_dir: Path, ready: str) -> Iterator[Proc]:
    """Start a server, wait until `ready` answers (a gRPC address, or an HTTP URL that
    must return 200), and stop it on the way out."""
    proc = start(name, argv, log_dir)
    try:
        if ready.startswith("http"):
            took = wait_http_ok(proc, ready)
        else:
            took = wait_grpc_serving(proc, ready)
        log.info("ready", system=name, seconds=round(took, 1))
        yield proc
    finally:
        proc.stop()


def _loopback(module: str, model: Path, port: int, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", module, "--model", str(model), "--port", str(port), *extra,
    ]  # fmt: skip


@contextlib.contextmanager
def pyworker(
    model: Path, log_dir: Path, settings: dict[str, Any] | None = None
) -> Iterator[Running]:
    """Switchyard's vLLM worker."""
    port = free_port()
    engine_args = json.dumps(ENGINE_SETTINGS if settings is None else settings)
    argv = _loopback("pyworker", model, port, "--engine-args", engine_args)
    with _server("pyworker", argv, log_dir, f"127.0.0.1:{port}") as proc:
        yield Running(f"127.0.0.1:{port}", proc.popen.pid)


@contextlib.contextmanager
def vllm_grpc_server(
    model: Path, log_dir: Path, settings: dict[str, Any] | None = None
) -> Iterator[Running]:
    port = free_port()
    flags = vllm_flags(ENGINE_SETTINGS if settings is None else settings)
    argv = _loopback("vllm.entrypoints.grpc_server", model, port, "--host", "127.0.0.1", *flags)
    with _server("vllm-grpc", argv, log_dir, f"127.0.0.1:{port}") as proc:
        yield Running(f"127.0.0.1:{port}", proc.popen.pid)


@contextlib.contextmanager
def smg_gateway(worker: str, log_dir: Path) -> Iterator[Running]:
    port = free_port()
    argv = [
        sys.executable, "-m", "smg", "launch", "--host", "127.0.0.1",
        "--port", str(port), "--worker-urls", f"grpc://{worker}", "--policy", "round_robin",
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
    ]  # fmt: skip
    with _server("smg", argv, log_dir, f"http://127.0.0.1:{port}/readiness") as proc:
        yield Running(f"http://127.0.0.1:{port}", proc.popen.pid)


@contextlib.contextmanager
def vllm_openai_server(
    model: Path, log_dir: Path, settings: dict[str, Any] | None = None
) -> Iterator[Running]:
    port = free_port()
    module = "vllm.entrypoints.openai.api_server"
    flags = vllm_flags(ENGINE_SETTINGS if settings is None else settings)
    argv = _loopback(module, model, port, "--host", "127.0.0.1", *flags)
    with _server("vllm-openai", argv, log_dir, f"http://127.0.0.1:{port}/health") as proc:
        yield Running(f"http://127.0.0.1:{port}", proc.popen.pid)


@contextlib.contextmanager
def sim_workers(n: int, log_dir: Path, step_us: int = 200) -> Iterator[list[str]]:
    """C++ workers on a simulator so fast that the engine is never the bottleneck."""
    with sim_worker_procs(n, log_dir, step_us) as procs:
        yield [p.address for p in procs]


@contextlib.contextmanager
def sim_worker_procs(n: int, log_dir: Path, step_us: int = 200) -> Iterator[list[Proc]]:
    """`sim_workers`, as their processes (each with its address)."""
    procs: list[Proc] = []
    try:
        for i in range(n):
            port = free_port()
            argv = [
                cpp_worker_binary(), "--engine", "sim", "--port", str(port),
                "--sim-vocab-size", "512", "--sim-max-context", "2048", "--sim-eos-id", "1",
                "--sim-decode-step-us", str(step_us), "--sim-decode-us-per-request", "0",
                "--sim-prefill-us-per-token", "0", "--sim-max-batch", "4096",
                "--sim-kv-blocks", "1000000",
            ]  # fmt: skip
            procs.append(start(f"sim-{i}", argv, log_dir, f"127.0.0.1:{port}"))
        for p in procs:
            wait_grpc_serving(p, p.address)
        yield procs
    finally:
        for p in procs:
            p.stop()


@contextlib.contextmanager
def engine_batches(addresses: list[str], into: dict[str, Any]) -> Iterator[None]:
    """Each worker's own count of running and waiting requests (its StreamLoad, every
    250 ms) while the block runs, summed up into `into["engine"]`: how full each engine's
    batch was, so that two systems on one engine compare their engine's steps, and a
    router split across two workers shows how even it was."""
    import grpc
    from switchyard.worker.v1 import worker_pb2, worker_pb2_grpc

    stop = threading.Event()
    seen: dict[str, list[tuple[int, int, float]]] = {a: [] for a in addresses}

    def watch(address: str) -> None:
        with grpc.insecure_channel(address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            call = stub.StreamLoad(worker_pb2.StreamLoadRequest(interval_ms=250))
            threading.Thread(target=lambda: (stop.wait(), call.cancel()), daemon=True).start()
            with contextlib.suppress(grpc.RpcError):
                for r in call:
                    seen[address].append(
                        (int(r.running), int(r.waiting), float(r.generation_tokens_per_s))
                    )

    threads = [threading.Thread(target=watch, args=(a,), daemon=True) for a in addresses]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join(5)
        into["engine"] = {a: batch_summary(v) for a, v in seen.items()}


def batch_summary(samples: list[tuple[int, int, float]]) -> dict[str, Any]:
    """Running and waiting over the samples where the engine had any work."""
    busy = [s for s in samples if s[0] or s[1]]
    if not busy:
        return {"samples": len(samples)}
    running = sorted(s[0] for s in busy)
    return {
        "samples": len(busy),
        "running_mean": round(sum(running) / len(running), 1),
        "running_p50": running[len(running) // 2],
        "running_max": running[-1],
        "waiting_mean": round(sum(s[1] for s in busy) / len(busy), 1),
        "tokens_per_s_mean": round(sum(s[2] for s in busy) / len(busy)),
    }
