"""The control plane's transport edge, reached as a hostile client reaches it: each kind
of bad attempt gets the status or the close a grpc++ server gives, the server keeps
serving others, and after many attempts nothing is left behind (file descriptors,
threads, memory; nothing in flight).

SWITCHYARD_EDGE_ATTEMPTS=10000 ./scripts/test tests/integration/fuzz/test_edge.py -s runs the full
size (attempts in all, every kind in turn); CI runs a few hundred."""

from __future__ import annotations

import random
import socket
import string
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from switchyard.v1 import admin_pb2, admin_pb2_grpc, generation_pb2

from control.fleet.local_workers import free_port
from tests.integration.fuzz import edge, wire
from tests.integration.fuzz.test_public_api import worker_in_flight
from tests.pki import Pki, make_pki
from tests.procs import Proc, serving_control

TOKEN = "edge-test-token-0123456789"
AUTH = [("authorization", f"Bearer {TOKEN}")]
MAX_MESSAGE = 65536
SETTLE_S = 30.0
SIM = (
    "  - name: sim\n"
    "    engine: sim\n"
    "    model: builtin:tiny\n"
    "    engine_args: {max_context: 2048, decode_step_us: 300}\n"
)


@dataclass
class Plane:
    proc: Proc
    host: str
    port: int
    metrics: str  # host:port of /metrics
    pki: Pki | None = None
    front: str = "python"  # api.front

    def tasks(self) -> int:
        """The control plane's asyncio tasks, as its metrics say (sampled every second)."""
        with urllib.request.urlopen(f"http://{self.metrics}/metrics", timeout=5) as r:
            text = r.read().decode()
        return next(
            int(sample.value)
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "switchyard_event_loop_tasks"
        )

    def ok(self) -> None:
        """A well-formed call, answered."""
        channel = (
            grpc.secure_channel(self.proc.address, grpc.ssl_channel_credentials(self.pki.ca))
            if self.pki is not None
            else grpc.insecure_channel(self.proc.address)
        )
        with channel:
            stub = channel.unary_unary(
                edge.LIST_MODELS,
                request_serializer=generation_pb2.ListModelsRequest.SerializeToString,
                response_deserializer=generation_pb2.ListModelsResponse.FromString,
            )
            out = stub(generation_pb2.ListModelsRequest(), metadata=AUTH, timeout=10)
            assert [m.name for m in out.models] == ["sim"]


def start_plane(
    tmp_path_factory: pytest.TempPathFactory, tls: bool, front: str = "python"
) -> Iterator[Plane]:
    tmp = tmp_path_factory.mktemp(("edge-tls" if tls else "edge") + f"-{front}")
    tokens = tmp / "tokens.yaml"
    tokens.write_text(f"tokens:\n  - {{name: edge, token: {TOKEN}, scopes: [generate, admin]}}\n")
    port, metrics = free_port(), free_port()
    pki = make_pki(tmp) if tls else None
    tls_line = f"tls: {{cert: {pki.server_cert}, key: {pki.server_key}}}\n" if pki else ""
    settings = (
        f"{tls_line}"
        f"metrics: {{listen: 127.0.0.1:{metrics}}}\n"
        f"auth: {{tokens_file: {tokens}}}\n"
        f"api: {{max_message_bytes: {MAX_MESSAGE}, front: {front}}}\n"
    )
    creds = grpc.ssl_channel_credentials(pki.ca) if pki else None
    with serving_control(
        tmp, SIM, settings=settings, port=port, timeout=120, credentials=creds
    ) as proc:
        plane = Plane(proc, "127.0.0.1", port, f"127.0.0.1:{metrics}", pki, front)
        _wait(lambda: _serves(plane), "the model to serve")
        yield plane


@pytest.fixture(scope="module", params=["python", "native"])
def plane(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Plane]:
    """On each api.front: hostile bytes meet grpc.aio, and grpc++ on the native front."""
    yield from start_plane(tmp_path_factory, tls=False, front=request.param)


@pytest.fixture(scope="module", params=["python", "native"])
def tls_plane(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Plane]:
    yield from start_plane(tmp_path_factory, tls=True, front=request.param)


def _serves(plane: Plane) -> bool:
    try:
        plane.ok()
        return True
    except (grpc.RpcError, AssertionError):
        return False


def _wait(condition: Callable[[], bool], what: str, timeout: float = SETTLE_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _letters(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(string.ascii_letters) for _ in range(n))


def _grpc_code(plane: Plane, method: str, body: bytes, metadata: list[tuple[str, str]]) -> str:
    with grpc.insecure_channel(plane.proc.address) as channel:
        stub = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
        try:
            stub(body, metadata=metadata, timeout=10)
            return "OK"
        except grpc.RpcError as e:
            return e.code().name  # type: ignore[attr-defined,no-any-return]


# Each kind: (what the client sends, what it must see). INTERNAL for a grpc-timeout that
# does not parse is gRPC core's own answer, before any handler: grpc++ and grpc-go give it.
Attempt = Callable[[Plane, random.Random], str]


def _h2(plane: Plane, path: str, headers: list[tuple[str, str]], body: bytes) -> str:
    return edge.h2_call(plane.host, plane.port, path, headers, body).status


KINDS: dict[str, tuple[Attempt, str]] = {
    "metadata over the limit, raw HTTP/2": (
        lambda p, r: _h2(
            p, edge.LIST_MODELS, [*AUTH, ("x-pad", _letters(r, 20000))], edge.list_models_body()
        ),
        "RESOURCE_EXHAUSTED",
    ),
    "metadata over the limit, grpc client": (
        lambda p, r: _grpc_code(
            p, edge.LIST_MODELS, edge.list_models_body(), [*AUTH, ("x-pad", "a" * 20000)]
        ),
        "RESOURCE_EXHAUSTED",
    ),
    "grpc-timeout that does not parse": (
        lambda p, r: _h2(
            p,
            edge.LIST_MODELS,
            [*AUTH, ("grpc-timeout", r.choice(["soon", "-1S", "10X", "", "1"]))],
            edge.list_models_body(),
        ),
        "INTERNAL",
    ),
    "grpc-timeout of years": (
        lambda p, r: _h2(
            p, edge.LIST_MODELS, [*AUTH, ("grpc-timeout", "99999999H")], edge.list_models_body()
        ),
        "OK",
    ),
    "authorization that is garbage": (
        lambda p, r: _h2(
            p,
            edge.LIST_MODELS,
            [("authorization", r.choice(["", "Bearer", "Basic "]) + _letters(r, r.randint(0, 99)))],
            edge.list_models_body(),
        ),
        "UNAUTHENTICATED",
    ),
    "unknown method": (
        lambda p, r: _h2(p, "/switchyard.v1.Generation/Nope", AUTH, b""),
        "UNIMPLEMENTED",
    ),
    "unknown service": (
        lambda p, r: _h2(p, f"/{_letters(r, 8)}.Service/Method", AUTH, b""),
        "UNIMPLEMENTED",
    ),
    "message over the receive limit": (
        lambda p, r: _grpc_code(
            p,
            "/switchyard.v1.Generation/Tokenize",
            generation_pb2.TokenizeRequest(model="sim", text="a" * MAX_MESSAGE).SerializeToString(),
            AUTH,
        ),
        "RESOURCE_EXHAUSTED",
    ),
    "HTTP/1.1 request": (
        lambda p, r: edge.send_raw(p.host, p.port, b"GET / HTTP/1.1\r\nHost: switchyard\r\n\r\n"),
        "CLOSED",
    ),
    "random bytes": (
        lambda p, r: edge.send_raw(p.host, p.port, r.randbytes(r.randint(24, 600))),
        "CLOSED",
    ),
    "HTTP/2 preface, then random bytes": (
        lambda p, r: edge.send_raw(p.host, p.port, edge.PREFACE + r.randbytes(r.randint(1, 600))),
        "CLOSED",
    ),
    "connection opened and dropped": (
        lambda p, r: _drop(p),
        "DROPPED",
    ),
}


# Where the native front's grpc core (Debian's 1.51, which it links) answers otherwise than
# grpcio's (1.84): a grpc-timeout it cannot parse is dropped, and the call is served with
# no deadline. Nothing is left behind either way (test_many_bad_attempts_leave_nothing_behind).
NATIVE_ANSWERS = {"grpc-timeout that does not parse": "OK"}


def expected_answer(plane: Plane, kind: str) -> str:
    if plane.front == "native" and kind in NATIVE_ANSWERS:
        return NATIVE_ANSWERS[kind]
    return KINDS[kind][1]


def _drop(plane: Plane) -> str:
    socket.create_connection((plane.host, plane.port), timeout=edge.SOCKET_TIMEOUT_S).close()
    return "DROPPED"


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_each_bad_attempt_gets_what_grpc_gives(plane: Plane, kind: str) -> None:
    attempt, expected = KINDS[kind][0], expected_answer(plane, kind)
    rng = random.Random(kind)
    for _ in range(3):
        assert attempt(plane, rng) == expected
    plane.ok()


def test_random_bytes_for_a_tls_handshake_are_closed(tls_plane: Plane) -> None:
    rng = random.Random(7)
    for _ in range(20):
        payload = rng.randbytes(rng.randint(1, 600))
        assert edge.send_raw(tls_plane.host, tls_plane.port, payload) == "CLOSED"
    tls_plane.ok()


def test_a_flood_of_connections_leaves_the_server_serving(plane: Plane) -> None:
    """Hundreds of connections opened at once and held silent: others are served
    meanwhile, and once they go the descriptors come back."""
    pid = plane.proc.popen.pid
    fds, _ = wire.usage(pid)
    held = [socket.create_connection((plane.host, plane.port), timeout=10) for _ in range(300)]
    try:
        plane.ok()
    finally:
        for s in held:
            s.close()
    _wait(lambda: wire.usage(pid)[0] <= fds + 2, "the flood's descriptors to close")
    plane.ok()


def test_many_bad_attempts_leave_nothing_behind(
    plane: Plane, capsys: pytest.CaptureFixture[str]
) -> None:
    count = edge.attempts(360)
    pid = plane.proc.popen.pid
    rng = random.Random(29)
    names = sorted(KINDS)
    for name in names:  # one of each first: what the server keeps from then on is its own
        KINDS[name][0](plane, rng)
    fds, rss = wire.usage(pid)
    threads, tasks = _threads(pid), plane.tasks()
    seen: Counter[str] = Counter()
    wrong: Counter[str] = Counter()
    for i in range(count):
        name = names[i % len(names)]
        attempt, expected = KINDS[name][0], expected_answer(plane, name)
        got = attempt(plane, rng)
        seen[got] += 1
        if got != expected:
            wrong[f"{name}: {got}"] += 1
    _wait(lambda: wire.usage(pid)[0] <= fds + 2, "descriptors back to where they were")
    _wait(lambda: plane.tasks() <= tasks + 2, "event-loop tasks back to where they were")
    after_fds, after_rss = wire.usage(pid)
    with capsys.disabled():
        print(
            f"\nedge attempts on the control plane: {count}, {dict(seen.most_common())}; "
            f"fds {fds} -> {after_fds}, threads {threads} -> {_threads(pid)}, "
            f"event-loop tasks {tasks} -> {plane.tasks()}, "
            f"RSS {rss // 1024} -> {after_rss // 1024} MiB"
        )
    assert not wrong, dict(wrong)
    assert _threads(pid) <= threads + 2
    plane.ok()
    _wait(lambda: _in_flight(plane) == 0, "nothing in flight")


def _in_flight(plane: Plane) -> int:
    """Requests in flight on the control plane and its workers, as Admin lists them."""
    with grpc.insecure_channel(plane.proc.address) as channel:
        listed = admin_pb2_grpc.AdminStub(channel).ListWorkers(
            admin_pb2.ListWorkersRequest(model="sim"), metadata=AUTH, timeout=10
        )
    assert listed.workers
    return sum(w.in_flight + worker_in_flight(w.address) for w in listed.workers)


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
