"""Traces across the control plane and the vLLM worker, received by an in-process OTLP
receiver (OpenTelemetry's own collector service, over gRPC).

The caller sends a W3C `traceparent`; the control plane's spans continue it, and the
vLLM worker it started (exporting to the same endpoint, as the control plane tells it)
continues the span of the worker attempt with vLLM's own `llm_request` span. A failover
is an event on the attempt it ends, and the next attempt is a sibling.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from switchyard.v1 import generation_pb2, generation_pb2_grpc

from control.fleet.local_workers import free_port
from switchyard.client import Client
from tests.procs import Proc, start_process, wait_serving, worker_pid

CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    events: tuple[str, ...]
    attributes: dict[str, Any]


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):  # type: ignore[misc]
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()

    def Export(self, request: Any, context: Any) -> Any:
        with self._lock:
            for rs in request.resource_spans:
                attrs = {a.key: a.value.string_value for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        self.spans.append(
                            ReceivedSpan(
                                service=attrs.get("service.name", ""),
                                name=s.name,
                                trace_id=s.trace_id.hex(),
                                span_id=s.span_id.hex(),
                                parent_id=s.parent_span_id.hex(),
                                events=tuple(e.name for e in s.events),
                                attributes={a.key: _value(a.value) for a in s.attributes},
                            )
                        )
        return trace_service_pb2.ExportTraceServiceResponse()

    def of_trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


@pytest.fixture(scope="module")
def receiver() -> Iterator[tuple[Receiver, str]]:
    r = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(r, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield r, f"127.0.0.1:{port}"
    finally:
        server.stop(None)


def wait_for_spans(
    r: Receiver, trace_id: str, names: set[str], timeout: float = 60
) -> list[ReceivedSpan]:
    deadline = time.monotonic() + timeout
    while True:
        spans = r.of_trace(trace_id)
        if names <= {s.name for s in spans}:
            return spans
        assert time.monotonic() < deadline, (
            f"spans {sorted(names - {s.name for s in spans})} never came; got "
            f"{sorted(s.name for s in spans)}"
        )
        time.sleep(0.1)


def start(tmp: Path, name: str, models: str, endpoint: str, extra: str = "") -> Proc:
    port = free_port()
    config = tmp / f"{name}.yaml"
    config.write_text(
        f"listen: 127.0.0.1:{port}\ntracing: {{otlp_endpoint: {endpoint}}}\n{extra}"
        f"models:\n{models}"
    )
    # Exported within 0.1 s instead of OpenTelemetry's default 5 s, here and in the
    # workers the control plane starts (they inherit its environment).
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "100"
    try:
        return start_process(["-m", "control", "serve", "--config", str(config)], port, tmp, name)
    finally:
        del os.environ["OTEL_BSP_SCHEDULE_DELAY"]


def traced(trace_id: str) -> list[tuple[str, str]]:
    return [("traceparent", f"00-{trace_id}-{CALLER_SPAN}-01")]


def test_spans_link_the_caller_the_control_plane_and_the_vllm_worker(
    receiver: tuple[Receiver, str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    r, endpoint = receiver
    proc = start(
        tmp_path,
        "ctl",
        "  - name: tiny\n"
        "    engine: vllm\n"
        f"    model: {tiny_model_dir}\n"
        "    engine_args: {max_model_len: 512}\n",
        endpoint,
    )
    try:
        wait_serving(proc, "tiny")
        # Through the client library, which sends the traceparent it is given.
        with Client(proc.address, timeout=60) as client:
            out = client.complete(
                "tiny",
                "Hello",
                max_tokens=4,
                ignore_eos=True,
                traceparent=f"00-{CALLER_TRACE}-{CALLER_SPAN}-01",
            )
            assert out.final.usage.completion_tokens == 4
        spans = wait_for_spans(
            r,
            CALLER_TRACE,
            {
                "switchyard.Complete",
                "switchyard.admission",
                "switchyard.route",
                "switchyard.worker_attempt",
                "llm_request",
            },
        )
    finally:
        assert proc.stop() == 0, proc.log_tail()
    by_name = {s.name: s for s in spans}
    rpc = by_name["switchyard.Complete"]
    assert rpc.parent_id == CALLER_SPAN  # the caller's trace, continued
    assert rpc.service == "switchyard-control"
    assert rpc.attributes["switchyard.model"] == "tiny"
    for child in ("switchyard.admission", "switchyard.route", "switchyard.worker_attempt"):
        assert by_name[child].parent_id == rpc.span_id, child
    attempt = by_name["switchyard.worker_attempt"]
    assert attempt.attributes["switchyard.worker"] == out.final.worker
    assert attempt.attributes["switchyard.tokens"] == 4
    engine = by_name["llm_request"]  # vLLM's span, in the worker's process
    assert engine.parent_id == attempt.span_id
    assert engine.service == "switchyard-vllm-worker"
    print(f"\ntrace {CALLER_TRACE} (caller's span {CALLER_SPAN}):")
    for s in sorted(spans, key=lambda s: (s.parent_id != CALLER_SPAN, s.name)):
        print(f"  {s.service:20} {s.name:28} span {s.span_id} parent {s.parent_id}")


def test_a_failover_is_an_event_and_the_next_attempt_a_sibling(
    receiver: tuple[Receiver, str], tmp_path: Path
) -> None:
    r, endpoint = receiver
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    metrics = f"127.0.0.1:{free_port()}"
    proc = start(
        tmp_path,
        "sim",
        "  - name: sim\n"
        "    engine: sim\n"
        "    model: builtin:tiny\n"
        "    replicas: 2\n"
        "    routing: round_robin\n"
        "    engine_args: {decode_step_us: 3000}\n",
        endpoint,
        f"metrics: {{listen: {metrics}}}\n",
    )
    try:
        wait_serving(proc, "sim", timeout=120)
        with grpc.insecure_channel(proc.address) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)

            def req(n: int) -> generation_pb2.GenerateRequest:
                stopping = generation_pb2.StoppingParams(max_tokens=n, ignore_eos=True)
                return generation_pb2.GenerateRequest(model="sim", text="Hi", stopping=stopping)

            # Round robin: the third request goes where the first went.
            victim = stub.Complete(req(2), timeout=10).final.worker
            other = stub.Complete(req(2), timeout=10).final.worker
            assert victim != other
            stream = stub.Generate(req(300), timeout=60, metadata=traced(trace_id))
            first = next(stream)
            assert first.chunk.token_ids
            os.kill(worker_pid(victim), signal.SIGKILL)
            final = next(m for m in stream if m.HasField("final")).final
            assert final.worker == other and final.usage.completion_tokens == 300
        spans = wait_for_spans(r, trace_id, {"switchyard.Generate", "switchyard.worker_attempt"})
        deadline = time.monotonic() + 30
        while len([s for s in spans if s.name == "switchyard.worker_attempt"]) < 2:
            assert time.monotonic() < deadline, spans
            time.sleep(0.1)
            spans = r.of_trace(trace_id)
        # The metrics count it too: one failover (the worker was lost), which was a resume.
        with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=5) as page:
            samples = {
                (s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(page.read().decode())
                for s in family.samples
            }
        failovers = ("switchyard_failovers_total", (("kind", "lost"), ("model", "sim")))
        assert samples[failovers] == 1
        assert samples[("switchyard_resumes_total", (("model", "sim"),))] == 1
    finally:
        assert proc.stop() == 0, proc.log_tail()
    rpc = next(s for s in spans if s.name == "switchyard.Generate")
    attempts = sorted(
        (s for s in spans if s.name == "switchyard.worker_attempt"),
        key=lambda s: s.attributes["switchyard.attempt"],
    )
    assert [a.attributes["switchyard.worker"] for a in attempts] == [victim, other]
    assert all(a.parent_id == rpc.span_id for a in attempts)
    assert attempts[0].events == ("failover",)
    assert attempts[1].attributes["switchyard.resumed_after_tokens"] > 0
    # The control plane's log line for the failover names the caller's trace.
    failover_lines = [
        line for line in proc.log_path.read_text().splitlines() if "failing over" in line
    ]
    assert failover_lines and all(f"trace_id={trace_id}" in line for line in failover_lines)
