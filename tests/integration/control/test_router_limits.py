"""Limits that hold for the whole service under `switchyard serve --routers 2`, as clients
see them: a token's request rate, and a model's admission limits (`limits`).

Every call here opens a connection of its own, so the kernel spreads them over both
processes (tests/integration/control/test_routers.py shows that it does). Kept per
process, as they were before the limits were shared (control/fleet/shared_limits.py),
both limits let two processes admit twice what is configured: the rate test would see
about twice its rate, and the admission test up to 4 running requests where 2 are
allowed.
"""

from __future__ import annotations

import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families
from switchyard.v1 import generation_pb2, generation_pb2_grpc

from control.fleet.local_workers import free_port
from control.fleet.shared_limits import LIMITS_FILE_ENV, SharedLimits
from tests.integration.control.test_routers import listeners
from tests.procs import Proc, serving_control

LIMITED = "limited-secret-0123456789abcdef"
FREE = "free-secret-0123456789abcdef"
RATE = 2.0  # the limited token's requests per second; its bucket holds 2
CLIENTS = 16
MAX_TOKENS = 40  # at 0.1 s a step: about 4 s a request
DEADLINE_S = 30.0
RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED

TOKENS = (
    "tokens:\n"
    f"  - {{name: limited, token: {LIMITED}, scopes: [generate], "
    f"rate_limit: {{requests_per_s: {RATE}}}}}\n"
    f"  - {{name: free, token: {FREE}, scopes: [generate]}}\n"
)
SLOW = (
    "  - name: slow\n"
    "    engine: sim\n"
    "    model: builtin:tiny\n"
    "    limits: {max_concurrency: 2, max_queue: 0}\n"
    "    engine_args: {decode_step_us: 100000}\n"
)


class Plane:
    def __init__(self, proc: Proc, metrics: str) -> None:
        self.proc = proc
        self.metrics = metrics  # host:port of the supervisor's /metrics

    def channel(self) -> grpc.Channel:
        """A connection of its own, as a separate client would open."""
        return grpc.insecure_channel(
            self.proc.address, options=[("grpc.use_local_subchannel_pool", 1)]
        )

    def running(self) -> float:
        """The service's running requests of `slow`: the processes' gauges, summed."""
        with urllib.request.urlopen(f"http://{self.metrics}/metrics", timeout=5) as r:
            text = r.read().decode()
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "switchyard_admission_running" and s.labels["model"] == "slow":
                    return s.value
        return 0.0


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Plane]:
    tmp = tmp_path_factory.mktemp("router-limits")
    tokens = tmp / "tokens.yaml"
    tokens.write_text(TOKENS)
    metrics = f"127.0.0.1:{free_port()}"
    settings = f"auth: {{tokens_file: {tokens}}}\nmetrics: {{listen: {metrics}}}\n"
    with serving_control(
        Path(tmp), SLOW, "slow", settings=settings, extra_args=["--routers", "2"]
    ) as proc:
        yield Plane(proc, metrics)


def bearer(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def outcome(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    try:
        call()
    except grpc.RpcError as e:
        return e.code(), e.details() or ""  # type: ignore[attr-defined]
    return grpc.StatusCode.OK, ""


def test_a_token_gets_its_rate_once_across_the_processes(plane: Plane) -> None:
    """Fresh connections for 3 s, four at a time: the token's bucket (2 requests, refilled
    at 2 a second) admits 2 + 2 x elapsed in all, not that in each process."""

    def tokenize() -> tuple[grpc.StatusCode, str]:
        with plane.channel() as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            request = generation_pb2.TokenizeRequest(model="slow", text="hi")
            return outcome(lambda: stub.Tokenize(request, metadata=bearer(LIMITED), timeout=10))

    def calls(until: float) -> list[grpc.StatusCode]:
        out = []
        while time.monotonic() < until:
            out.append(tokenize()[0])
        return out

    started = time.monotonic()
    with ThreadPoolExecutor(4) as pool:
        done = list(pool.map(calls, [started + 3.0] * 4))
    elapsed = time.monotonic() - started
    codes = Counter(code for thread in done for code in thread)
    assert set(codes) == {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
    allowed = 2 + RATE * elapsed
    assert allowed - 2 <= codes[grpc.StatusCode.OK] <= allowed, (codes, elapsed)
    assert codes[grpc.StatusCode.RESOURCE_EXHAUSTED] > 20, codes  # calls came fast enough


def admit_at_once(plane: Plane) -> tuple[list[tuple[grpc.StatusCode, str]], set[int], set[int]]:
    """CLIENTS requests for `slow` at once, each on a connection of its own: their
    outcomes, the pids that serve the port, and those that served some of them."""
    channels = [plane.channel() for _ in range(CLIENTS)]
    start = threading.Barrier(CLIENTS)
    request = generation_pb2.GenerateRequest(
        model="slow",
        text="Hello",
        stopping=generation_pb2.StoppingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
    )

    def complete(ch: grpc.Channel) -> tuple[grpc.StatusCode, str]:
        stub = generation_pb2_grpc.GenerationStub(ch)
        start.wait()
        return outcome(lambda: stub.Complete(request, metadata=bearer(FREE), timeout=60))

    try:
        with ThreadPoolExecutor(CLIENTS) as pool:
            results = list(pool.map(complete, channels))
        port = int(plane.proc.address.rpartition(":")[2])
        pids = listeners(port)
        served = {
            pid
            for pid in pids
            for c in psutil.Process(pid).net_connections("tcp")
            if c.status == psutil.CONN_ESTABLISHED and c.laddr.port == port
        }
    finally:
        for ch in channels:
            ch.close()
    return results, pids, served


def test_a_models_limits_hold_across_the_processes_and_slots_come_back(plane: Plane) -> None:
    """16 clients at once on a model that runs 2 and queues none: 2 run, 14 are refused
    at once; both processes had some. Once those 2 end, the next 16 again get 2: no slot
    is left behind."""
    for _ in range(2):
        results, pids, served = admit_at_once(plane)
        codes = Counter(code for code, _ in results)
        assert codes == {grpc.StatusCode.OK: 2, grpc.StatusCode.RESOURCE_EXHAUSTED: 14}, results
        refused = [d for code, d in results if code == grpc.StatusCode.RESOURCE_EXHAUSTED]
        assert all("2 running, 0 queued (limits 2 and 0)" in d for d in refused), refused
        assert len(pids) == 2 and served == pids, "one process took every connection"
        wait_until_idle(plane, int(plane.proc.address.rpartition(":")[2]))


def test_the_slots_of_a_router_that_dies_come_back(plane: Plane) -> None:
    """SIGKILL the router while it runs some of the 2 admitted requests (where it runs
    none, the round ends and another starts): its supervisor gives back what it held, so
    once the rest end, 2 are admitted again. Without that, its slots would stay taken."""
    port = int(plane.proc.address.rpartition(":")[2])
    router = (listeners(port) - {plane.proc.popen.pid}).pop()
    # Where the slots are, from the file the processes share (opened as one more process).
    limits = SharedLimits(Path(psutil.Process(router).environ()[LIMITS_FILE_ENV]))
    try:
        for _ in range(10):
            with ThreadPoolExecutor(1) as pool:
                first = pool.submit(admit_at_once, plane)
                deadline = time.monotonic() + DEADLINE_S
                while limits.counts("slow")[0] < 2 and not first.done():
                    assert time.monotonic() < deadline, "2 never ran"
                    time.sleep(0.02)
                held = limits.held(router, "slow")[0]
                if held:
                    psutil.Process(router).kill()
                results = first.result()[0]
            wait_until_idle(plane, port)
            if held:
                break
        else:
            pytest.fail("the router never ran one of the 2")
        assert limits.held(router, "slow") == (0, 0)
    finally:
        limits.close()
    # The router started again: it serves once it says so (and loads its model before).
    deadline = time.monotonic() + DEADLINE_S
    while plane.proc.log_path.read_text(errors="replace").count("role=router") < 2:
        assert time.monotonic() < deadline, "the router did not serve again"
        time.sleep(0.05)
    killed = [r for r in results if r[0] not in (grpc.StatusCode.OK, RESOURCE_EXHAUSTED)]
    # The clients of those it ran heard of it (and those it had not yet refused).
    assert len(killed) >= held, results
    codes = Counter(code for code, _ in admit_at_once(plane)[0])
    assert codes == {grpc.StatusCode.OK: 2, RESOURCE_EXHAUSTED: 14}, codes


def wait_until_idle(plane: Plane, port: int) -> None:
    """Until nothing runs and both processes serve the port (a router killed is
    started again)."""
    deadline = time.monotonic() + DEADLINE_S
    while plane.running() != 0 or len(listeners(port)) != 2:
        assert time.monotonic() < deadline, f"{plane.running()} running, {listeners(port)}"
        time.sleep(0.05)
