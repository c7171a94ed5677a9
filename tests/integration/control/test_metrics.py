"""Metrics as an operator reads them: a real Prometheus (Debian's `prometheus`) scrapes
two control planes under traffic, and the series are read back through its HTTP API.

One control plane serves two engines (the session's real vLLM worker and two C++
simulator workers): its one scrape covers every worker, with the same names. The other
runs `--routers 2`: its supervisor's endpoint adds up what both processes counted.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from switchyard.v1 import common_pb2, generation_pb2, generation_pb2_grpc

from control.fleet.local_workers import free_port
from tests.procs import Proc, serve_startup_failure, start_process, wait_serving

SIM = (
    "  - name: sim-tiny\n"
    "    engine: sim\n"
    "    model: builtin:tiny\n"
    "    replicas: 2\n"
    "    routing: round_robin\n"
    "    engine_args: {max_context: 4096, decode_step_us: 1000}\n"
)
DEADLINE_S = 90.0


@dataclass
class Plane:
    proc: Proc
    metrics: str  # host:port of /metrics


def start_plane(tmp: Path, name: str, models: str, *extra: str) -> Plane:
    port, metrics_port = free_port(), free_port()
    config = tmp / f"{name}.yaml"
    config.write_text(
        f"listen: 127.0.0.1:{port}\nmetrics: {{listen: 127.0.0.1:{metrics_port}}}\n"
        f"models:\n{models}"
    )
    argv = ["-m", "control", "serve", "--config", str(config), *extra]
    proc = start_process(argv, port, tmp, name)
    return Plane(proc, f"127.0.0.1:{metrics_port}")


@pytest.fixture(scope="module")
def planes(
    worker: Proc, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Plane, Plane]]:
    tmp = tmp_path_factory.mktemp("metrics")
    vllm = (
        "  - name: tiny\n"
        "    engine: vllm\n"
        f"    model: {tiny_model_dir}\n"
        f"    workers: [{worker.address}]\n"
    )
    single = start_plane(tmp, "single", SIM + vllm)
    routed = start_plane(tmp, "routed", SIM, "--routers", "2")
    try:
        wait_serving(single.proc, "sim-tiny", timeout=120)
        wait_serving(single.proc, "tiny", timeout=120)
        wait_serving(routed.proc, "sim-tiny", timeout=120)
        yield single, routed
    finally:
        for p in (single.proc, routed.proc):
            assert p.stop() == 0, p.log_tail()


class Prometheus:
    """A real Prometheus server scraping `targets` every second."""

    def __init__(self, tmp: Path, targets: dict[str, str]) -> None:
        binary = shutil.which("prometheus")
        assert binary, "prometheus is not installed (scripts/setup.sh installs it for tests)"
        jobs = [
            {
                "job_name": job,
                "scrape_interval": "1s",
                "scrape_timeout": "900ms",
                "static_configs": [{"targets": [target]}],
            }
            for job, target in targets.items()
        ]
        config = tmp / "prometheus.yml"
        config.write_text(json.dumps({"scrape_configs": jobs}))  # JSON is YAML
        self.address = f"127.0.0.1:{free_port()}"
        self.log = (tmp / "prometheus.log").open("w")
        self.proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp / 'data'}",
                f"--web.listen-address={self.address}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        wait_for(lambda: self._ready(), "Prometheus ready", 60)

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited with {self.proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://{self.address}/-/ready", timeout=2) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def query(self, promql: str) -> dict[tuple[tuple[str, str], ...], float]:
        """An instant query: {sorted labels: value}."""
        url = f"http://{self.address}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(url, timeout=5) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        return {
            tuple(sorted(item["metric"].items())): float(item["value"][1])
            for item in body["data"]["result"]
        }

    def value(self, promql: str) -> float | None:
        result = self.query(promql)
        assert len(result) <= 1, result
        return next(iter(result.values()), None)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()


def wait_for(condition: Callable[[], Any], what: str, timeout: float = DEADLINE_S) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def wait_value(prom: Prometheus, promql: str, expected: float) -> None:
    seen: list[float | None] = []

    def check() -> bool:
        seen.append(prom.value(promql))
        return seen[-1] == expected

    try:
        wait_for(check, f"{promql} == {expected}")
    except AssertionError as e:
        raise AssertionError(f"{e}; last value {seen[-1]!r}") from None


@pytest.fixture(scope="module")
def prom(
    planes: tuple[Plane, Plane], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Prometheus]:
    single, routed = planes
    p = Prometheus(
        tmp_path_factory.mktemp("prometheus"), {"single": single.metrics, "routed": routed.metrics}
    )
    try:
        yield p
    finally:
        p.stop()


def request(model: str, max_tokens: int, **kw: Any) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        model=model,
        text="Hello",
        stopping=generation_pb2.StoppingParams(max_tokens=max_tokens, ignore_eos=True),
        **kw,
    )


def stream_tokens(stub: generation_pb2_grpc.GenerationStub, req: Any) -> int:
    tokens = 0
    for resp in stub.Generate(req, timeout=60):
        if resp.HasField("final"):
            assert resp.final.usage.completion_tokens == tokens
        else:
            tokens += len(resp.chunk.token_ids)
    return tokens


def test_prometheus_scrapes_one_plane_covering_both_engines(
    planes: tuple[Plane, Plane], prom: Prometheus
) -> None:
    single, _ = planes
    wait_value(prom, 'up{job="single"}', 1.0)
    tokens = {"sim-tiny": 0, "tiny": 0}
    with grpc.insecure_channel(single.proc.address) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        for _ in range(6):
            tokens["sim-tiny"] += stream_tokens(stub, request("sim-tiny", 8))
        for _ in range(3):
            tokens["tiny"] += stream_tokens(stub, request("tiny", 4))
        bad = request("sim-tiny", 8, sampling=common_pb2.SamplingParams(temperature=-1))
        with pytest.raises(grpc.RpcError) as e:
            stub.Complete(bad, timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as e:
            stub.Complete(request("no-such-model", 8), timeout=10)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert tokens == {"sim-tiny": 48, "tiny": 12}

    job = 'job="single"'
    wait_value(
        prom, f'switchyard_requests_total{{{job},model="sim-tiny",rpc="Generate",code="OK"}}', 6
    )
    wait_value(prom, f'switchyard_requests_total{{{job},model="tiny",rpc="Generate",code="OK"}}', 3)
    wait_value(
        prom,
        f'switchyard_requests_total{{{job},model="sim-tiny",rpc="Complete",code="INVALID_ARGUMENT"}}',
        1,
    )
    # An unknown name is not a series of its own: it counts under model="".
    wait_value(prom, f'switchyard_requests_total{{{job},model="",code="NOT_FOUND"}}', 1)
    for model, n in tokens.items():
        wait_value(prom, f'switchyard_generation_tokens_total{{{job},model="{model}"}}', n)
    wait_value(prom, f'switchyard_time_to_first_token_seconds_count{{{job},model="tiny"}}', 3)
    wait_value(prom, f'switchyard_e2e_request_latency_seconds_count{{{job},model="sim-tiny"}}', 6)
    # A stream of k tokens has k - 1 gaps between them, one observation per chunk after
    # the first (chunks that came together are one): 1 to 3 for each stream here.
    itl = f'switchyard_inter_token_latency_seconds_count{{{job},model="tiny"}}'
    wait_for(lambda: 3 <= (prom.value(itl) or 0) <= 9, f"{itl} from 3 to 9")
    assert (prom.value(itl.replace("_count", "_sum")) or 0) > 0
    wait_value(
        prom,
        f'switchyard_request_success_total{{{job},model="tiny",finished_reason="length"}}',
        3,
    )
    wait_value(prom, f'switchyard_admission_running{{{job},model="sim-tiny"}}', 0)

    # Every worker behind the one scrape, whichever engine, under the same names.
    workers = prom.query(f"switchyard_worker_kv_cache_blocks_total{{{job}}}")
    by_engine: dict[str, int] = {}
    for labels, blocks in workers.items():
        engine = dict(labels)["engine"]
        by_engine[engine] = by_engine.get(engine, 0) + 1
        assert blocks > 0, labels
    assert by_engine == {"sim": 2, "vllm": 1}
    closed = prom.query(f'switchyard_worker_state{{{job},state="closed"}} == 1')
    assert len(closed) == 3
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert len(prom.query(f"switchyard_worker_{name}{{{job}}}")) == 3, name
    # A quantile of the TTFT histogram, as a dashboard asks for it.
    p50 = prom.value(
        f"histogram_quantile(0.5, sum by (le) "
        f'(switchyard_time_to_first_token_seconds_bucket{{{job},model="sim-tiny"}}))'
    )
    assert p50 is not None and 0 < p50 < 5
    # What an operator's query returns (shown with pytest -s).
    by_code = prom.query(f"sum by (model, rpc, code) (switchyard_requests_total{{{job}}})")
    print("\nsum by (model, rpc, code) (switchyard_requests_total):")
    for labels, value in sorted(by_code.items()):
        print(f"  {dict(labels)} {value:g}")
    print(f"TTFT p50 (sim-tiny) from the histogram: {p50:.4f} s")


def test_cancellations_are_counted_by_cause(planes: tuple[Plane, Plane], prom: Prometheus) -> None:
    single, _ = planes
    job = 'job="single"'
    with grpc.insecure_channel(single.proc.address) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        # client: it goes away after the first chunk of a long stream.
        call = stub.Generate(request("sim-tiny", 3000), timeout=60)
        next(iter(call))
        call.cancel()
        # deadline: the stream ends with TIME_LIMIT before its 3000 tokens.
        out = stub.Complete(request("sim-tiny", 3000), timeout=0.5)
        assert out.final.finish_reason == common_pb2.FinishReason.FINISH_REASON_TIME_LIMIT
        # stop string: a piece of what the same greedy request says without one.
        greedy = common_pb2.SamplingParams(temperature=0)
        text = stub.Complete(request("sim-tiny", 24, sampling=greedy), timeout=30).text
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        assert stop.strip(), text
        stopping = generation_pb2.StoppingParams(max_tokens=24, ignore_eos=True, stop=[stop])
        out = stub.Complete(
            generation_pb2.GenerateRequest(
                model="sim-tiny", text="Hello", sampling=greedy, stopping=stopping
            ),
            timeout=30,
        )
        assert out.final.stop_string == stop
    for cause in ("client", "deadline", "stop_string"):
        wait_value(
            prom,
            f'switchyard_request_cancellations_total{{{job},model="sim-tiny",cause="{cause}"}}',
            1,
        )
    wait_value(prom, f'switchyard_requests_total{{{job},model="sim-tiny",code="CANCELLED"}}', 1)
    assert (
        prom.value(
            f'switchyard_request_cancellations_total{{{job},model="sim-tiny",cause="failover"}}'
        )
        == 0
    )


def test_a_body_that_does_not_parse_counts_as_a_client_error(
    planes: tuple[Plane, Plane], prom: Prometheus
) -> None:
    """Bytes that are no GenerateRequest: INVALID_ARGUMENT for the client, counted as a
    client error of no model, and by method, added up over the routers."""
    _, routed = planes
    generate = "/switchyard.v1.Generation/Generate"
    malformed = f'sum(switchyard_malformed_requests_total{{job="routed",method="{generate}"}})'
    requests = (
        'sum(switchyard_requests_total{job="routed",model="",rpc="Generate",'
        'code="INVALID_ARGUMENT"})'
    )
    before = {q: prom.value(q) or 0.0 for q in (malformed, requests)}
    for _ in range(3):  # one connection each: the kernel may hand them to either router
        with grpc.insecure_channel(routed.proc.address) as ch:
            raw = ch.unary_stream(generate, request_serializer=None, response_deserializer=None)
            with pytest.raises(grpc.RpcError) as caught:
                list(raw(b"\xff\xff\xff", timeout=10))
            assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    for query, was in before.items():
        wait_value(prom, query, was + 3)


def scrape(address: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as r:
        text = r.read().decode()
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def test_routers_are_added_up_in_one_scrape(planes: tuple[Plane, Plane], prom: Prometheus) -> None:
    _, routed = planes
    # Separate connections, as separate clients: the kernel spreads them over both
    # processes (tests/integration/control/test_routers.py shows that it does).
    channels = [
        grpc.insecure_channel(routed.proc.address, options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(16)
    ]
    # One long stream: the control plane gives the counter its tokens in batches (64 at a
    # time, the rest at the end), and all of them before the client sees the Final.
    lengths = [150] + [4] * (len(channels) - 1)
    try:
        for ch, n in zip(channels, lengths, strict=True):
            stub = generation_pb2_grpc.GenerationStub(ch)
            assert stream_tokens(stub, request("sim-tiny", n)) == n
    finally:
        for ch in channels:
            ch.close()
    samples = scrape(routed.metrics)
    key = (("code", "OK"), ("model", "sim-tiny"), ("rpc", "Generate"))
    assert samples["switchyard_requests_total"][key] == 16
    assert samples["switchyard_generation_tokens_total"][(("model", "sim-tiny"),)] == sum(lengths)
    # Prometheus takes the summed families (one HELP and TYPE each) as they are.
    wait_value(prom, 'up{job="routed"}', 1.0)
    wait_value(prom, 'switchyard_requests_total{job="routed",model="sim-tiny",code="OK"}', 16)
    wait_value(prom, 'switchyard_e2e_request_latency_seconds_count{job="routed"}', 16)


def test_a_metrics_port_in_use_fails_the_start_naming_the_key(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = tmp_path / "busy.yaml"
        config.write_text(
            f"listen: 127.0.0.1:{free_port()}\nmetrics: {{listen: 127.0.0.1:{port}}}\n"
            f"models:\n{SIM}"
        )
        line = serve_startup_failure(config)
    assert f"metrics.listen 127.0.0.1:{port}: cannot listen" in line
