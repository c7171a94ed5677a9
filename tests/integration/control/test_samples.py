"""Several samples of one prompt (`n`): fanned out by the control plane as separate engine
requests, on every engine alike. With a seed, sample i is the n = 1 request with seed + i;
every chunk and Final carries its sample's index; the last Final counts every sample; a
cancelled call cancels them all."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from switchyard.v1 import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc

from switchyard.client import Client, InvalidArgument
from tests.procs import Proc, serving_control


@pytest.fixture(scope="module")
def plane(
    worker: Proc, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Proc]:
    models = (
        f"  - {{name: tiny, engine: vllm, model: {tiny_model_dir}, workers: [{worker.address}]}}\n"
        "  - {name: sim, engine: sim, model: builtin:tiny, replicas: 2,"
        " engine_args: {decode_step_us: 2000}}\n"
    )
    tmp = tmp_path_factory.mktemp("samples")
    with serving_control(tmp, models, "tiny", "sim", timeout=120) as proc:
        yield proc


@pytest.mark.parametrize("model", ["tiny", "sim"])
def test_sample_i_is_the_single_request_with_seed_plus_i(plane: Proc, model: str) -> None:
    options = {"max_tokens": 12, "ignore_eos": True, "temperature": 1.0}
    with Client(plane.address, timeout=120) as client:
        prompt = client.tokenize(model, "Which track").token_ids
        out = client.complete(model, prompt, n=3, seed=40, **options)
        singles = [client.complete(model, prompt, seed=40 + i, **options) for i in range(3)]
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.token_ids for c in out.choices] == [s.token_ids for s in singles]
    assert [c.text for c in out.choices] == [s.text for s in singles]
    assert out.text == out.choices[0].text and out.final.index == 0
    # Usage: each sample's own, and all of them (the prompt once) in total_usage.
    assert [c.final.usage.completion_tokens for c in out.choices] == [12, 12, 12]
    assert out.final.total_usage is not None
    assert out.final.total_usage.completion_tokens == 36
    assert out.final.total_usage.prompt_tokens == len(prompt)
    assert {c.final.request_id for c in out.choices} == {out.final.request_id}


def test_streamed_samples_carry_their_index(plane: Proc) -> None:
    with Client(plane.address, timeout=120) as client:
        whole = client.complete("sim", "Hi", n=4, seed=7, max_tokens=10, ignore_eos=True)
        stream = client.generate("sim", "Hi", n=4, seed=7, max_tokens=10, ignore_eos=True)
        by_index: dict[int, list[int]] = {}
        with stream:
            for chunk in stream:
                by_index.setdefault(chunk.index, []).extend(chunk.token_ids)
    assert sorted(by_index) == [0, 1, 2, 3]
    assert [tuple(by_index[i]) for i in range(4)] == [c.token_ids for c in whole.choices]
    finals = stream.finals
    assert sorted(f.index for f in finals) == [0, 1, 2, 3]
    assert [f.total_usage is not None for f in finals] == [False, False, False, True]
    assert stream.final is finals[-1] or stream.final == finals[-1]


def test_cancelling_the_call_cancels_every_sample(plane: Proc) -> None:
    req = generation_pb2.GenerateRequest(
        model="sim", text="Hi", n=4,
        stopping=generation_pb2.StoppingParams(max_tokens=2000, ignore_eos=True),
    )  # fmt: skip
    with grpc.insecure_channel(plane.address) as ch:
        call = generation_pb2_grpc.GenerationStub(ch).Generate(req, timeout=60)
        seen: set[int] = set()
        for msg in call:
            seen.add(msg.chunk.index)
            if len(seen) == 4:
                break
        assert in_flight(ch) == 4  # every sample on a worker
        call.cancel()
        deadline = time.monotonic() + 20
        while in_flight(ch) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert in_flight(ch) == 0


def in_flight(ch: grpc.Channel) -> int:
    admin = admin_pb2_grpc.AdminStub(ch)
    listed = admin.ListWorkers(admin_pb2.ListWorkersRequest(model="sim"), timeout=10)
    return sum(w.in_flight for w in listed.workers)


def test_too_many_samples_name_the_field(plane: Proc) -> None:
    with Client(plane.address, timeout=30) as client, pytest.raises(InvalidArgument) as bad:
        client.complete("sim", "Hi", n=17, max_tokens=2)
    assert [v.field for v in bad.value.violations] == ["n"]
