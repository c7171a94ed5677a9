"""End to end: a gRPC client, the control plane, a real vLLM worker on the tiny model."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from switchyard.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from switchyard.worker.v1 import worker_pb2, worker_pb2_grpc

from control.text.tokenizer import Tokenizer
from tests.procs import Proc

pytestmark = pytest.mark.engine
FR = common_pb2.FinishReason


@pytest.fixture(scope="module", params=["control", "aio_control"])
def stub(request: pytest.FixtureRequest) -> Iterator[generation_pb2_grpc.GenerationStub]:
    """The control plane on each api.front, in front of the session's vLLM worker."""
    proc: Proc = request.getfixturevalue(request.param)
    with grpc.insecure_channel(proc.address) as ch:
        yield generation_pb2_grpc.GenerationStub(ch)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer(str(tiny_model_dir))


def request(text: str = "Hello, world", **stopping: object) -> generation_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(temperature=0.0)
    return generation_pb2.GenerateRequest(
        model="tiny",
        text=text,
        sampling=sampling,
        stopping=generation_pb2.StoppingParams(**stopping),  # type: ignore[arg-type]
    )


def stream(
    stub: generation_pb2_grpc.GenerationStub, req: generation_pb2.GenerateRequest
) -> tuple[list[generation_pb2.Chunk], generation_pb2.Final]:
    chunks: list[generation_pb2.Chunk] = []
    finals: list[generation_pb2.Final] = []
    for resp in stub.Generate(req, timeout=60):
        assert not finals, "a message arrived after the final"
        if resp.HasField("chunk"):
            chunks.append(resp.chunk)
        else:
            finals.append(resp.final)
    assert len(finals) == 1
    return chunks, finals[0]


def worker_running(worker: Proc) -> int:
    with grpc.insecure_channel(worker.address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        call = stub.StreamLoad(worker_pb2.StreamLoadRequest(interval_ms=20), timeout=5)
        report = next(iter(call))
        call.cancel()
        return report.running


def wait_worker_idle(worker: Proc, within_s: float) -> float:
    """Seconds until the worker reports no running request; fails after `within_s`."""
    start = time.monotonic()
    while True:
        if worker_running(worker) == 0:
            return time.monotonic() - start
        if time.monotonic() - start > within_s:
            pytest.fail(f"worker still reports running requests after {within_s} s")
        time.sleep(0.02)


def test_stream_matches_complete(
    stub: generation_pb2_grpc.GenerationStub, tokenizer: Tokenizer
) -> None:
    req = request("The quick brown fox", max_tokens=40, ignore_eos=True)
    req.sampling.seed = 7
    chunks, final = stream(stub, req)
    done = stub.Complete(req, timeout=60)
    streamed_text = "".join(c.text for c in chunks)
    streamed_ids = [t for c in chunks for t in c.token_ids]
    assert streamed_text == done.text
    assert streamed_ids == list(done.token_ids)
    assert len(streamed_ids) == final.usage.completion_tokens == 40
    assert final.finish_reason == FR.FINISH_REASON_LENGTH
    assert final.usage.prompt_tokens == len(
        stub.Tokenize(
            generation_pb2.TokenizeRequest(model="tiny", text="The quick brown fox")
        ).token_ids
    )
    # Random weights emit stray UTF-8 bytes too; whatever the text, the stream must equal
    # decoding all the ids at once (held-back characters came out whole).
    assert streamed_text == tokenizer.decode(streamed_ids, skip_special_tokens=True)
    assert final.worker and final.engine.startswith("vllm ")
    assert final.timing.total_ms >= final.timing.time_to_first_token_ms > 0


def test_max_tokens_ends_with_length(stub: generation_pb2_grpc.GenerationStub) -> None:
    chunks, final = stream(stub, request(max_tokens=5, ignore_eos=True))
    assert final.finish_reason == FR.FINISH_REASON_LENGTH
    assert sum(len(c.token_ids) for c in chunks) == 5 == final.usage.completion_tokens


def test_ignore_eos(stub: generation_pb2_grpc.GenerationStub) -> None:
    """Find a seeded generation that ends on EOS, then replay it with ignore_eos."""
    eos_run: tuple[int, generation_pb2.CompleteResponse] | None = None
    for seed in range(200):
        req = request("Hello", max_tokens=128)
        req.sampling.temperature = 1.0
        req.sampling.seed = seed
        out = stub.Complete(req, timeout=60)
        if out.final.WhichOneof("stop_reason") == "eos_token_id":
            eos_run = (seed, out)
            break
    assert eos_run is not None, "no seed in 0..199 ended on EOS; cannot check ignore_eos"
    seed, out = eos_run
    assert out.final.finish_reason == FR.FINISH_REASON_STOP
    n = out.final.usage.completion_tokens
    req = request("Hello", max_tokens=n + 8, ignore_eos=True)
    req.sampling.temperature = 1.0
    req.sampling.seed = seed
    again = stub.Complete(req, timeout=60)
    assert again.final.finish_reason == FR.FINISH_REASON_LENGTH
    assert again.final.usage.completion_tokens == n + 8
    # The same tokens up to EOS, then it kept going.
    assert list(again.token_ids[:n]) == list(out.token_ids[:n])


def test_stop_string_across_chunks_aborts_worker(
    stub: generation_pb2_grpc.GenerationStub, worker: Proc, tokenizer: Tokenizer
) -> None:
    base = request("Tokens stream back", max_tokens=60, ignore_eos=True)
    chunks, _ = stream(stub, base)
    full = "".join(c.text for c in chunks)
    # A stop string that straddles the boundary between two chunks, where it first occurs.
    stop = None
    boundary = 0
    for c in chunks[:-1]:
        boundary += len(c.text)
        candidate = full[boundary - 2 : boundary + 1]
        if boundary >= 6 and len(candidate) == 3 and full.index(candidate) == boundary - 2:
            stop = candidate
            break
    assert stop, f"no usable chunk boundary in {[c.text for c in chunks]!r}"
    expected = full[: full.index(stop)]

    req = request("Tokens stream back", max_tokens=60, ignore_eos=True, stop=[stop])
    chunks, final = stream(stub, req)
    assert final.finish_reason == FR.FINISH_REASON_STOP
    assert final.stop_string == stop
    assert "".join(c.text for c in chunks) == expected
    ids = [t for c in chunks for t in c.token_ids]
    assert final.usage.completion_tokens == len(ids) < 60
    # The last token is the one that completed the stop string; nothing after it counts.
    assert stop in tokenizer.decode(ids, skip_special_tokens=True)
    assert stop not in tokenizer.decode(ids[:-1], skip_special_tokens=True)
    wait_worker_idle(worker, within_s=1.0)

    req.stopping.include_stop_str_in_output = True
    chunks, final = stream(stub, req)
    assert "".join(c.text for c in chunks) == expected + stop


def test_client_cancel_frees_worker(stub: generation_pb2_grpc.GenerationStub, worker: Proc) -> None:
    call = stub.Generate(request(max_tokens=1500, ignore_eos=True), timeout=60)
    got = 0
    for resp in call:
        got += len(resp.chunk.token_ids)
        if got >= 3:
            break
    assert worker_running(worker) == 1
    call.cancel()
    took = wait_worker_idle(worker, within_s=1.0)
    assert took < 1.0


def test_concurrent_streams(stub: generation_pb2_grpc.GenerationStub) -> None:
    results: list[int] = []
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            _chunks, final = stream(stub, request(f"Hello {i}", max_tokens=20, ignore_eos=True))
            results.append(final.usage.completion_tokens)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    assert results == [20] * 16


def _bad_request_fields(err: grpc.RpcError) -> list[str]:
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    assert status is not None, "no rich status details"
    fields: list[str] = []
    for detail in status.details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            fields += [v.field for v in bad.field_violations]
    return fields


def _set_temperature(r: generation_pb2.GenerateRequest) -> None:
    r.sampling.temperature = -0.5


def _set_top_p_zero(r: generation_pb2.GenerateRequest) -> None:
    r.sampling.top_p = 0.0


def _set_top_p_high(r: generation_pb2.GenerateRequest) -> None:
    r.sampling.top_p = 1.5


def _set_max_tokens_zero(r: generation_pb2.GenerateRequest) -> None:
    r.stopping.max_tokens = 0


def _set_empty_prompt(r: generation_pb2.GenerateRequest) -> None:
    r.text = ""


def _set_long_prompt(r: generation_pb2.GenerateRequest) -> None:
    r.text = "Hello world " * 3000


def _set_bad_token(r: generation_pb2.GenerateRequest) -> None:
    r.token_ids.ids[:] = [0, 324, 99999]


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (_set_temperature, "sampling.temperature"),
        (_set_top_p_zero, "sampling.top_p"),
        (_set_top_p_high, "sampling.top_p"),
        (_set_max_tokens_zero, "stopping.max_tokens"),
        (_set_empty_prompt, "text"),
        (_set_long_prompt, "text"),
        (_set_bad_token, "token_ids.ids[2]"),
    ],
)
@pytest.mark.parametrize("rpc", ["Generate", "Complete"])
def test_invalid_input_names_the_field(
    stub: generation_pb2_grpc.GenerationStub, mutate: object, field: str, rpc: str
) -> None:
    req = request(max_tokens=4)
    mutate(req)  # type: ignore[operator]
    with pytest.raises(grpc.RpcError) as info:
        if rpc == "Generate":
            list(stub.Generate(req, timeout=30))
        else:
            stub.Complete(req, timeout=30)
    err = info.value
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert field in _bad_request_fields(err)
    assert field.split("[")[0] in err.details()  # type: ignore[attr-defined]
    # The service keeps serving.
    ok = stub.Complete(request(max_tokens=2, ignore_eos=True), timeout=30)
    assert ok.final.usage.completion_tokens == 2


def test_unknown_model_is_not_found(stub: generation_pb2_grpc.GenerationStub) -> None:
    req = request(max_tokens=2)
    req.model = "no-such-model"
    with pytest.raises(grpc.RpcError) as info:
        stub.Complete(req, timeout=30)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]
    assert "no-such-model" in info.value.details()  # type: ignore[attr-defined]


def test_list_models_and_tokenize(stub: generation_pb2_grpc.GenerationStub) -> None:
    models = stub.ListModels(generation_pb2.ListModelsRequest(), timeout=10).models
    assert [m.name for m in models] == ["tiny"]
    assert models[0].max_context == 2048 and models[0].healthy_workers == 1
    tok = stub.Tokenize(generation_pb2.TokenizeRequest(model="tiny", text="Hello 🚂"), timeout=10)
    assert len(tok.token_ids) == len(tok.tokens) >= 3
    assert tok.token_ids[0] == 0  # BOS


def test_token_id_prompt_and_logprobs(stub: generation_pb2_grpc.GenerationStub) -> None:
    req = generation_pb2.GenerateRequest(
        model="tiny",
        token_ids=generation_pb2.TokenIds(ids=[0, 324, 474]),
        sampling=common_pb2.SamplingParams(temperature=0.0),
        stopping=generation_pb2.StoppingParams(max_tokens=6, ignore_eos=True),
        output=generation_pb2.OutputOptions(logprobs=3),
    )
    out = stub.Complete(req, timeout=30)
    assert len(out.token_ids) == 6 == len(out.logprobs)
    for tid, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp.token_id == tid
        assert lp.logprob <= 0.0
        assert len(lp.top) == 3
        # Greedy: the chosen token is the most likely one.
        assert lp.top[0].token_id == tid
        assert all(t.token for t in lp.top)
