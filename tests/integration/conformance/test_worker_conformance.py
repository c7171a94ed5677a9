"""The worker contract (switchyard.worker.v1.Worker), checked the same way on every worker.

Each test runs against the vLLM worker and against the C++ worker on its simulator.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status
from switchyard.v1 import common_pb2
from switchyard.worker.v1 import worker_pb2, worker_pb2_grpc

from tests.integration.conformance.conftest import start_cpp_worker
from tests.procs import Proc, start_process, wait_serving

pytestmark = pytest.mark.engine
PROMPT = [0, 324, 474, 222]
FR = common_pb2.FinishReason


@pytest.fixture(scope="module")
def channels() -> Iterator[dict[str, grpc.Channel]]:
    opened: dict[str, grpc.Channel] = {}
    yield opened
    for ch in opened.values():
        ch.close()


@pytest.fixture
def stub(any_worker: Proc, channels: dict[str, grpc.Channel]) -> Any:
    ch = channels.get(any_worker.address)
    if ch is None:
        ch = channels[any_worker.address] = grpc.insecure_channel(any_worker.address)
    return worker_pb2_grpc.WorkerStub(ch)


def request(max_tokens: int = 16, request_id: str = "", **kw: Any) -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=PROMPT,
        max_tokens=max_tokens,
        ignore_eos=True,
        sampling=common_pb2.SamplingParams(temperature=0.0),
        **kw,
    )


def generate(
    stub: Any, req: worker_pb2.GenerateRequest, timeout: float = 60
) -> tuple[list[worker_pb2.Chunk], worker_pb2.Final]:
    chunks: list[worker_pb2.Chunk] = []
    finals: list[worker_pb2.Final] = []
    for msg in stub.Generate(req, timeout=timeout):
        assert not finals, "a message after the final"
        if msg.HasField("chunk"):
            chunks.append(msg.chunk)
        else:
            finals.append(msg.final)
    assert len(finals) == 1, "exactly one final"
    return chunks, finals[0]


def load_report(stub: Any) -> Any:
    call = stub.StreamLoad(worker_pb2.StreamLoadRequest(interval_ms=10), timeout=5)
    report = next(iter(call))
    call.cancel()
    return report


def running(stub: Any) -> int:
    return int(load_report(stub).running)


def in_flight(stub: Any) -> int:
    """Requests the worker holds, whatever the engine runs for them."""
    return int(load_report(stub).in_flight)


def wait_idle(stub: Any, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while running(stub) != 0:
        assert time.monotonic() < deadline, f"still running {within_s} s later"
        time.sleep(0.01)


def test_stream_order_one_final_and_token_counts(stub: Any) -> None:
    chunks, final = generate(stub, request(max_tokens=24))
    ids = [t for c in chunks for t in c.token_ids]
    assert len(ids) == 24 == final.usage.completion_tokens
    assert final.usage.prompt_tokens == len(PROMPT)
    assert final.finish_reason == FR.FINISH_REASON_LENGTH
    assert all(0 <= t < 512 for t in ids)
    assert final.time_to_first_token_ms > 0
    # Greedy is deterministic: the same ids again.
    again, _ = generate(stub, request(max_tokens=24))
    assert [t for c in again for t in c.token_ids] == ids


def test_stop_token_ends_with_stop(stub: Any) -> None:
    chunks, _ = generate(stub, request(max_tokens=12))
    ids = [t for c in chunks for t in c.token_ids]
    stop = ids[5]
    first = ids.index(stop)
    chunks, final = generate(stub, request(max_tokens=12, stop_token_ids=[stop]))
    got = [t for c in chunks for t in c.token_ids]
    assert final.finish_reason == FR.FINISH_REASON_STOP
    assert final.stop_token_id == stop
    assert got == ids[: first + 1]
    assert final.usage.completion_tokens == len(got)


def test_cancel_mid_stream_frees_the_slot(stub: Any) -> None:
    call = stub.Generate(request(max_tokens=1500), timeout=60)
    got = 0
    for msg in call:
        got += len(msg.chunk.token_ids)
        if got >= 3:
            break
    assert running(stub) == 1
    call.cancel()
    wait_idle(stub, within_s=1.0)


def test_abort_by_id_ends_with_cancelled(stub: Any, engine: str) -> None:
    rid = f"abort-me-{engine}"
    result: dict[str, Any] = {}

    def consume() -> None:
        result["out"] = generate(stub, request(max_tokens=1500, request_id=rid))

    t = threading.Thread(target=consume)
    t.start()
    deadline = time.monotonic() + 10
    while running(stub) == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    aborted = stub.Abort(worker_pb2.AbortRequest(request_ids=[rid, "nobody"]), timeout=5)
    t.join(30)
    assert aborted.aborted == 1
    chunks, final = result["out"]
    assert final.finish_reason == FR.FINISH_REASON_CANCELLED
    assert final.usage.completion_tokens == sum(len(c.token_ids) for c in chunks) < 1500
    wait_idle(stub, within_s=1.0)


def test_deadline_ends_with_time_limit(stub: Any) -> None:
    started = time.monotonic()
    chunks, final = generate(stub, request(max_tokens=1900), timeout=0.4)
    assert time.monotonic() - started < 0.4 + 0.2
    assert final.finish_reason == FR.FINISH_REASON_TIME_LIMIT
    assert final.usage.completion_tokens == sum(len(c.token_ids) for c in chunks) < 1900
    wait_idle(stub, within_s=1.0)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"prompt_token_ids": []}, "prompt_token_ids"),
        ({"prompt_token_ids": [0, 5, 99999]}, "prompt_token_ids[2]"),
        ({"prompt_token_ids": [5] * 2049}, "prompt_token_ids"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"prompt_token_ids": [5] * 2000, "max_tokens": 100}, "max_tokens"),
        ({"sampling": common_pb2.SamplingParams(temperature=-1.0)}, "sampling.temperature"),
        ({"sampling": common_pb2.SamplingParams(top_p=0.0)}, "sampling.top_p"),
    ],
)
def test_invalid_input_is_invalid_argument(stub: Any, change: dict[str, Any], field: str) -> None:
    req = request(max_tokens=4)
    for key, value in change.items():
        if isinstance(value, list):
            del getattr(req, key)[:]
            getattr(req, key).extend(value)
        elif key == "sampling":
            req.sampling.CopyFrom(value)
        else:
            setattr(req, key, value)
    with pytest.raises(grpc.RpcError) as info:
        generate(stub, req)
    err: Any = info.value
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    status = rpc_status.from_call(err)
    assert status is not None
    fields = []
    for d in status.details:
        bad = error_details_pb2.BadRequest()
        if d.Unpack(bad):
            fields += [v.field for v in bad.field_violations]
    assert field in fields
    # Still serving.
    _, final = generate(stub, request(max_tokens=2))
    assert final.usage.completion_tokens == 2


def test_stream_load_reflects_running_requests(stub: Any) -> None:
    calls = [stub.Generate(request(max_tokens=1500, request_id=""), timeout=60) for _ in range(2)]
    try:
        for c in calls:
            next(iter(c))  # both have started
        assert running(stub) == 2
    finally:
        for c in calls:
            c.cancel()
    wait_idle(stub, within_s=1.0)
    call = stub.StreamLoad(worker_pb2.StreamLoadRequest(interval_ms=50), timeout=5)
    stamps = []
    for report in call:
        stamps.append(report.timestamp_s)
        if len(stamps) == 3:
            break
    call.cancel()
    assert stamps == sorted(stamps) and stamps[-1] - stamps[0] >= 0.08


def test_get_info(stub: Any, engine: str) -> None:
    info = stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=5)
    assert info.engine == engine
    assert info.engine_version
    assert info.max_context == 2048
    assert info.vocab_size >= 512
    assert list(info.eos_token_ids) == [1]
    assert info.kv_block_size > 0
    # What each engine declares it can do through the API.
    caps = info.capabilities
    assert info.HasField("capabilities") and caps.max_n == 1
    assert caps.max_logprobs == (20 if engine == "vllm" else 0)
    # Beam search: vLLM's own (2 x width log probabilities a step, within max_logprobs).
    assert caps.beam_search == (engine == "vllm")
    assert caps.max_beam_width == (10 if engine == "vllm" else 0)
    # LoRA: the simulator has it by default; the session's vLLM worker was started without.
    assert caps.lora == (engine == "sim")
    # vLLM's structured outputs take every kind; the simulator takes none.
    kinds = ["choice", "grammar", "json_object", "json_schema", "regex"]
    assert list(caps.structured_output) == (kinds if engine == "vllm" else [])


@pytest.mark.parametrize(
    ("constraint", "check"),
    [
        (common_pb2.OutputConstraint(regex="[a-c]{2}-[0-9]"), r"[a-c]{2}-[0-9]"),
        (common_pb2.OutputConstraint(choice=common_pb2.Choices(values=["one", "two"])), "one|two"),
    ],
)
def test_structured_output_where_declared_and_refused_elsewhere(
    stub: Any, engine: str, tiny_model_dir: Path, constraint: Any, check: str
) -> None:
    import re

    from transformers import AutoTokenizer

    kind = constraint.WhichOneof("kind")
    declared = (
        kind in stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=5).capabilities.structured_output
    )
    req = worker_pb2.GenerateRequest(
        request_id=f"so-{engine}-{kind}", prompt_token_ids=PROMPT, max_tokens=24,
        sampling=common_pb2.SamplingParams(temperature=1.0, seed=7), constraint=constraint,
    )  # fmt: skip
    if not declared:
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(req, timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"constraint.{kind}" in (e.value.details() or "")
        return
    chunks, final = generate(stub, req)
    ids = [t for c in chunks for t in c.token_ids]
    assert final.finish_reason == FR.FINISH_REASON_STOP
    text = AutoTokenizer.from_pretrained(str(tiny_model_dir)).decode(ids, skip_special_tokens=True)
    assert re.fullmatch(check, text), text


def test_prompt_logprobs_where_declared_and_refused_elsewhere(stub: Any, engine: str) -> None:
    caps = stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=5).capabilities
    assert caps.prompt_logprobs == (engine == "vllm")
    req = request(max_tokens=4, request_id=f"plp-{engine}", prompt_logprobs=2)
    if not caps.prompt_logprobs:
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(req, timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "prompt_logprobs" in (e.value.details() or "")
        return
    chunks, final = generate(stub, req)
    first, *rest = chunks
    # One per prompt token after the first, in the first chunk only.
    assert [lp.token_id for lp in first.prompt_logprobs] == PROMPT[1:]
    assert all(lp.logprob <= 0 and 1 <= len(lp.top) <= 2 for lp in first.prompt_logprobs)
    assert not any(c.prompt_logprobs for c in rest)
    assert final.usage.completion_tokens == 4


def test_adapters_where_declared_and_refused_elsewhere(
    stub: Any, engine: str, tmp_path: Path
) -> None:
    """A worker that declares LoRA loads a (PEFT-shaped) adapter, lists it, serves a
    request naming it differently from the base model, and after UnloadAdapter refuses
    the name (NOT_FOUND on `adapter`); one that does not refuses both calls with
    FAILED_PRECONDITION."""
    from switchyard_common.rpc_status import read_details

    caps = stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=5).capabilities
    (tmp_path / "adapter_config.json").write_text('{"r": 4, "lora_alpha": 8}')
    load = worker_pb2.LoadAdapterRequest(name=f"conf-{engine}", path=str(tmp_path))
    named = request(max_tokens=8, request_id=f"lora-{engine}", adapter=f"conf-{engine}")
    if not caps.lora:
        for call in (lambda: stub.LoadAdapter(load, timeout=30),
                     lambda: list(stub.Generate(named, timeout=30))):  # fmt: skip
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        return
    assert stub.LoadAdapter(load, timeout=30).adapter.rank == 4
    held = {a.name for a in stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=5).adapters}
    assert f"conf-{engine}" in held
    base = [t for c in generate(stub, request(max_tokens=8))[0] for t in c.token_ids]
    chunks, final = generate(stub, named)
    assert [t for c in chunks for t in c.token_ids] != base and final.usage.completion_tokens == 8
    unloaded = stub.UnloadAdapter(
        worker_pb2.UnloadAdapterRequest(name=f"conf-{engine}", grace_ms=5000), timeout=30
    )
    assert unloaded.cancelled_requests == 0
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(named, timeout=30))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert [v.field for v in read_details(e.value.trailing_metadata()).violations] == ["adapter"]


def test_beam_search_where_declared_and_refused_elsewhere(stub: Any, engine: str) -> None:
    caps = stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=5).capabilities
    assert caps.beam_search == (engine == "vllm")
    req = request(max_tokens=5, request_id=f"beams-{engine}", beam_width=3)
    if not caps.beam_search:
        assert caps.max_beam_width == 0
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(req, timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "beam_width" in (e.value.details() or "")
        return
    assert caps.max_beam_width >= 3
    chunks, final = generate(stub, req)
    assert not chunks, "the beams come in the final"
    assert len(final.beams) == 3
    assert len({tuple(b.token_ids) for b in final.beams}) == 3
    assert all(len(b.token_ids) == 5 and b.cumulative_logprob < 0 for b in final.beams)
    assert all(b.finish_reason == FR.FINISH_REASON_LENGTH for b in final.beams)
    assert final.usage.completion_tokens == 15
    assert final.usage.prompt_tokens == len(PROMPT)
    # Over GenerateStream (the control plane's path): the same beams.
    streamed = request(max_tokens=5, beam_width=3, attempt_id=1)
    call = stub.GenerateStream(iter([worker_pb2.StreamRequest(start=[streamed])]), timeout=60)
    events = [e for msg in call for e in msg.events]
    assert [e.WhichOneof("event") for e in events] == ["final"]
    assert [list(b.token_ids) for b in events[0].final.beams] == [
        list(b.token_ids) for b in final.beams
    ]
    # What the search does not take is refused, naming the field.
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(request(max_tokens=5, beam_width=2, min_tokens=2), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "min_tokens" in (e.value.details() or "")
    # An Abort ends a long search with CANCELLED, and nothing is left held.
    rid = "abort-the-beams"
    result: dict[str, Any] = {}

    def consume() -> None:
        long = request(max_tokens=1500, request_id=rid, beam_width=2)
        result["out"] = generate(stub, long, timeout=120)

    t = threading.Thread(target=consume)
    t.start()
    deadline = time.monotonic() + 10
    while in_flight(stub) == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    aborted = stub.Abort(worker_pb2.AbortRequest(request_ids=[rid]), timeout=5)
    t.join(60)
    assert aborted.aborted == 1
    assert result["out"][1].finish_reason == FR.FINISH_REASON_CANCELLED
    deadline = time.monotonic() + 5
    while in_flight(stub) != 0:
        assert time.monotonic() < deadline, "the aborted search is still held"
        time.sleep(0.01)


def test_logprobs_beyond_the_declared_limit_are_refused(stub: Any, engine: str) -> None:
    limit = stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=5).capabilities.max_logprobs
    req = worker_pb2.GenerateRequest(
        request_id=f"lp-{engine}", prompt_token_ids=[5, 6], max_tokens=2, logprobs=limit + 1
    )
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(req, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    req.request_id, req.logprobs = f"lp-ok-{engine}", limit
    finals = [m.final for m in stub.Generate(req, timeout=30) if m.HasField("final")]
    assert finals and finals[0].usage.completion_tokens == 2


def _start_fresh(engine: str, tmp: Path, tiny_model_dir: Path) -> Proc:
    if engine == "sim":
        return start_cpp_worker(tmp, "drain-cpp")
    from control.fleet.local_workers import free_port

    port = free_port()
    proc = start_process(
        ["-m", "pyworker", "--model", str(tiny_model_dir), "--port", str(port)],
        port,
        tmp,
        "drain-pyworker",
    )
    wait_serving(proc)
    return proc


def test_health_serving_then_not_serving_on_drain(
    engine: str, tmp_path: Path, tiny_model_dir: Path
) -> None:
    proc = _start_fresh(engine, tmp_path, tiny_model_dir)
    with contextlib.ExitStack() as stack:
        stack.callback(proc.stop)
        ch = stack.enter_context(grpc.insecure_channel(proc.address))
        health = health_pb2_grpc.HealthStub(ch)
        stub = worker_pb2_grpc.WorkerStub(ch)
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == (
            health_pb2.HealthCheckResponse.SERVING
        )
        watch = health.Watch(health_pb2.HealthCheckRequest(), timeout=30)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        # A stream in flight when the drain starts still completes.
        long_call = stub.Generate(request(max_tokens=40), timeout=60)
        first = next(iter(long_call))
        assert first.HasField("chunk")
        proc.popen.terminate()
        statuses = []
        with contextlib.suppress(grpc.RpcError):
            for r in watch:
                statuses.append(r.status)
                if r.status == health_pb2.HealthCheckResponse.NOT_SERVING:
                    break
        watch.cancel()
        assert health_pb2.HealthCheckResponse.NOT_SERVING in statuses
        rest = list(long_call)
        assert rest[-1].HasField("final")
        assert rest[-1].final.finish_reason == FR.FINISH_REASON_LENGTH
        assert proc.popen.wait(30) == 0


def check_cadence(sizes: list[int], total: int, interval: int) -> None:
    """The first tokens at once, then chunks of at least `interval`, the rest last."""
    assert sum(sizes) == total
    assert sizes[0] < interval, sizes  # the first step's token, not held for the cadence
    assert all(n >= interval for n in sizes[1:-1]), sizes
    assert len(sizes) <= 2 + (total - sizes[0]) // interval, sizes


def test_stream_interval_sends_fewer_larger_chunks_of_the_same_tokens(stub: Any) -> None:
    info = stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=10)
    assert info.capabilities.stream_interval
    plain, _ = generate(stub, request(max_tokens=30))
    chunks, final = generate(stub, request(max_tokens=30, stream_interval=8, logprobs=0))
    check_cadence([len(c.token_ids) for c in chunks], 30, 8)
    assert [t for c in chunks for t in c.token_ids] == [t for c in plain for t in c.token_ids]
    assert all(len(c.logprobs) == len(c.token_ids) for c in chunks)
    assert final.usage.completion_tokens == 30
    assert final.finish_reason == FR.FINISH_REASON_LENGTH
