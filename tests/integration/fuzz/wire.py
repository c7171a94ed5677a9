"""Hostile bytes for any Switchyard server: random bodies, truncations and bit flips of
valid encoded requests, sent to every RPC of a service through a generic channel with
identity serializers (what a client built from a stale .proto, a proxy that cut a frame,
or a scanner sends). What each call ended with is counted by status code."""

from __future__ import annotations

import os
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import Message
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2
from grpc_status import rpc_status
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from switchyard.v1 import admin_pb2, generation_pb2
from switchyard.worker.v1 import worker_pb2

# A body no protobuf parser accepts: a field tag whose varint never ends.
GARBAGE = b"\xff\xff\xff\xff\xff"
# How long a response stream that accepted its request may stay open before the fuzz
# moves on (it then counts as OPEN).
OPEN_AFTER_S = 0.5
CALL_TIMEOUT_S = 15.0
LOCAL_CANCEL = "Locally cancelled by application!"
# Never the client's fault: a body that does not parse must not end with these.
SERVER_FAULTS = frozenset({"UNKNOWN", "INTERNAL", "UNIMPLEMENTED", "DATA_LOSS"})


def cases(default: int) -> int:
    """Calls per server: SWITCHYARD_WIRE_FUZZ_CASES (the full run: 10000)."""
    return int(os.environ.get("SWITCHYARD_WIRE_FUZZ_CASES", default))


@dataclass(frozen=True)
class Rpc:
    method: str  # /package.Service/Method
    seed: Message  # a valid request, which the fuzz cuts and flips
    request_stream: bool
    response_stream: bool

    @property
    def type_name(self) -> str:
        return self.seed.DESCRIPTOR.full_name


def rpcs_of(service: str, seeds: dict[str, Message], descriptor_of: object) -> list[Rpc]:
    """Every method of `service` (a ServiceDescriptor's owner module), each with its seed;
    a method without one is an error here, so a new RPC cannot go unfuzzed."""
    desc = descriptor_of.DESCRIPTOR.services_by_name[service]  # type: ignore[attr-defined]
    missing = {m.name for m in desc.methods} - set(seeds)
    assert not missing, f"{desc.full_name}: no seed for {sorted(missing)}"
    return [
        Rpc(
            f"/{desc.full_name}/{m.name}",
            seeds[m.name],
            m.client_streaming,
            m.server_streaming,
        )
        for m in desc.methods
    ]


def generation_rpcs(model: str) -> list[Rpc]:
    g = generation_pb2
    request = g.GenerateRequest(model=model, text="Hello", stopping=g.StoppingParams(max_tokens=4))
    seeds: dict[str, Message] = {
        "Generate": request,
        "Complete": request,
        "Tokenize": g.TokenizeRequest(model=model, text="Hello"),
        "ListModels": g.ListModelsRequest(),
    }
    return rpcs_of("Generation", seeds, g)


def admin_rpcs(model: str) -> list[Rpc]:
    """Seeds that cannot change the fleet however they are cut: names nothing serves."""
    a = admin_pb2
    seeds: dict[str, Message] = {
        "LoadModel": a.LoadModelRequest(spec=a.ModelSpec(name="fz", engine="none")),
        "UnloadModel": a.UnloadModelRequest(name="fz-none"),
        "ListWorkers": a.ListWorkersRequest(model=model),
        "DrainWorker": a.DrainWorkerRequest(address="127.0.0.1:1", grace_s=0.1),
        "LoadAdapter": a.LoadAdapterRequest(model="fz-none", name="fz", path="/nonexistent"),
        "UnloadAdapter": a.UnloadAdapterRequest(model="fz-none", name="fz"),
        "ListAdapters": a.ListAdaptersRequest(model=model),
    }
    return rpcs_of("Admin", seeds, a)


def health_rpcs(service: str) -> list[Rpc]:
    check = health_pb2.HealthCheckRequest(service=service)
    seeds: dict[str, Message] = {
        "Check": check,
        "Watch": check,
        "List": health_pb2.HealthListRequest(),
    }
    return rpcs_of("Health", seeds, health_pb2)


def reflection_rpcs() -> list[Rpc]:
    ask = reflection_pb2.ServerReflectionRequest(list_services="")
    return rpcs_of("ServerReflection", {"ServerReflectionInfo": ask}, reflection_pb2)


def worker_rpcs() -> list[Rpc]:
    w = worker_pb2
    request = w.GenerateRequest(prompt_token_ids=[5, 6, 7, 8], max_tokens=4, attempt_id=1)
    seeds: dict[str, Message] = {
        "Generate": request,
        "GenerateStream": w.StreamRequest(start=[request]),
        "Abort": w.AbortRequest(request_ids=["fz-none"]),
        "GetInfo": w.GetInfoRequest(),
        "StreamLoad": w.StreamLoadRequest(interval_ms=50),
        "LoadAdapter": w.LoadAdapterRequest(name="fz", path="/nonexistent"),
        "UnloadAdapter": w.UnloadAdapterRequest(name="fz-none"),
        "SubscribeKvEvents": w.SubscribeKvEventsRequest(),
    }
    return rpcs_of("Worker", seeds, w)


@st.composite
def bodies(draw: st.DrawFn, seed: bytes) -> bytes:
    """Random bytes, a valid encoding cut short, or one with a few bits flipped."""
    kind = draw(st.sampled_from(("random", "truncated", "flipped")))
    if kind == "random" or not seed:
        return draw(st.binary(min_size=1, max_size=64))
    if kind == "truncated":
        return seed[: draw(st.integers(0, len(seed) - 1))]
    body = bytearray(seed)
    for _ in range(draw(st.integers(1, 3))):
        bit = draw(st.integers(0, len(body) * 8 - 1))
        body[bit // 8] ^= 1 << (bit % 8)
    return bytes(body)


def raw_stub(channel: grpc.Channel, rpc: Rpc) -> Any:
    """A callable for `rpc` on `channel` that sends and returns bytes as they are."""
    kind = ("stream" if rpc.request_stream else "unary") + "_"
    kind += "stream" if rpc.response_stream else "unary"
    return getattr(channel, kind)(rpc.method, request_serializer=None, response_deserializer=None)


def send(channel: grpc.Channel, rpc: Rpc, body: bytes, timeout: float = CALL_TIMEOUT_S) -> None:
    """One call with `body` as its request (the only message of a request stream), read to
    its end; a status other than OK raises grpc.RpcError."""
    result = raw_stub(channel, rpc)(iter([body]) if rpc.request_stream else body, timeout=timeout)
    if rpc.response_stream:
        for _ in result:
            pass


def call(channel: grpc.Channel, rpc: Rpc, body: bytes) -> str:
    """One call with `body` as the request (each message of a request stream): the status
    code's name, or OPEN for a response stream that accepted it and kept streaming."""
    request = iter([body]) if rpc.request_stream else body
    try:
        if not rpc.response_stream:
            send(channel, rpc, body)
            return "OK"
        responses = raw_stub(channel, rpc)(request, timeout=CALL_TIMEOUT_S)
        timer = threading.Timer(OPEN_AFTER_S, responses.cancel)
        timer.start()
        try:
            for _ in responses:
                pass
        finally:
            timer.cancel()
        return "OK"
    except grpc.RpcError as e:
        code: grpc.StatusCode = e.code()  # type: ignore[attr-defined]
        if code is grpc.StatusCode.CANCELLED and e.details() == LOCAL_CANCEL:  # type: ignore[attr-defined]
            return "OPEN"  # still streaming when the timer cancelled it here
        return code.name


def assert_malformed(err: grpc.RpcError, type_name: str, size: int = len(GARBAGE)) -> None:
    """What a client sees for a body of `size` bytes that is not an encoding of
    `type_name` (a full protobuf name): INVALID_ARGUMENT naming it, with one BadRequest
    on the field `request`."""
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details())  # type: ignore[attr-defined]
    message = f"request body is not a valid encoding of {type_name} ({size} bytes)"
    assert err.details() == message  # type: ignore[attr-defined]
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    assert status is not None, "no google.rpc.Status details"
    assert len(status.details) == 1
    bad = error_details_pb2.BadRequest()
    assert status.details[0].Unpack(bad)
    assert [(v.field, v.description) for v in bad.field_violations] == [("request", message)]


def fuzz(
    address: str,
    rpcs: list[Rpc],
    count: int,
    credentials: grpc.ChannelCredentials | None = None,
) -> dict[str, Counter[str]]:
    """`count` generated calls spread over `rpcs`, four at a time; codes by method."""
    seen: dict[str, Counter[str]] = {r.method: Counter() for r in rpcs}
    lock = threading.Lock()
    channel = (
        grpc.secure_channel(address, credentials)
        if credentials is not None
        else grpc.insecure_channel(address)
    )
    with channel, ThreadPoolExecutor(4) as pool:

        def one(rpc: Rpc, body: bytes) -> None:
            code = call(channel, rpc, body)
            with lock:
                seen[rpc.method][code] += 1

        @settings(
            max_examples=max(1, count // 4),
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(batch=st.lists(_cases(rpcs), min_size=4, max_size=4))
        def batches(batch: list[tuple[Rpc, bytes]]) -> None:
            list(pool.map(lambda case: one(*case), batch))

        batches()
    return seen


def _cases(rpcs: list[Rpc]) -> st.SearchStrategy[tuple[Rpc, bytes]]:
    return st.sampled_from(rpcs).flatmap(
        lambda rpc: st.tuples(st.just(rpc), bodies(rpc.seed.SerializeToString()))
    )


def server_faults(seen: dict[str, Counter[str]]) -> dict[str, dict[str, int]]:
    return {
        method: {code: n for code, n in codes.items() if code in SERVER_FAULTS}
        for method, codes in seen.items()
        if any(code in SERVER_FAULTS for code in codes)
    }


def totals(seen: dict[str, Counter[str]]) -> Counter[str]:
    out: Counter[str] = Counter()
    for codes in seen.values():
        out.update(codes)
    return out


def usage(pid: int) -> tuple[int, int]:
    """(open file descriptors, resident set in KiB) of a process."""
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    status = Path(f"/proc/{pid}/status").read_text()
    rss = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
    return fds, rss
