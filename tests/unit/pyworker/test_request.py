"""Parsing worker GenerateRequests: field-named errors, and unset fields left to vLLM."""

from __future__ import annotations

from typing import Any

import pytest
from switchyard.v1 import common_pb2
from switchyard.worker.v1 import worker_pb2

from pyworker.engine import EngineInfo
from pyworker.errors import InvalidArgument
from pyworker.request import parse_generate

INFO = EngineInfo(
    engine="vllm",
    engine_version="test",
    model="tiny",
    max_context=64,
    vocab_size=512,
    eos_token_ids=(1,),
    kv_block_size=16,
    kv_blocks_total=100,
    max_logprobs=20,
    priority_scheduling=False,
)


def request(**fields: Any) -> Any:
    sampling = fields.pop("sampling", {})
    fields.setdefault("prompt_token_ids", [0, 5, 6])
    fields.setdefault("max_tokens", 8)
    return worker_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(**sampling), **fields)


def violated_fields(req: Any) -> list[str]:
    with pytest.raises(InvalidArgument) as err:
        parse_generate(req, INFO)
    return [v.field for v in err.value.violations]


def test_unset_sampling_fields_keep_vllm_defaults() -> None:
    parsed = parse_generate(request(), INFO)
    params = parsed.sampling_params
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (1.0, 1.0, 0, 0.0)
    assert params.seed is None
    assert params.logprobs is None
    assert params.max_tokens == 8
    assert params.detokenize is False


def test_set_fields_reach_sampling_params() -> None:
    parsed = parse_generate(
        request(
            min_tokens=2,
            stop_token_ids=[7, 9],
            ignore_eos=True,
            logprobs=0,
            priority=5,
            sampling={
                "temperature": 0.5,
                "top_p": 0.9,
                "top_k": -1,
                "min_p": 0.1,
                "repetition_penalty": 1.2,
                "presence_penalty": -0.5,
                "frequency_penalty": 0.5,
                "seed": 2**64 - 1,
            },
        ),
        INFO,
    )
    params = parsed.sampling_params
    assert params.temperature == pytest.approx(0.5)
    assert params.top_p == pytest.approx(0.9)
    assert params.top_k == 0  # -1 means disabled
    assert params.min_p == pytest.approx(0.1)
    assert params.repetition_penalty == pytest.approx(1.2)
    assert params.presence_penalty == pytest.approx(-0.5)
    assert params.frequency_penalty == pytest.approx(0.5)
    assert params.seed == 2**64 - 1
    assert (params.min_tokens, params.ignore_eos, params.logprobs) == (2, True, 0)
    assert parsed.stop_token_ids == {7, 9}
    assert parsed.priority == 0  # the engine does not schedule by priority


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"prompt_token_ids": []}, ["prompt_token_ids"]),
        ({"prompt_token_ids": [0, 512]}, ["prompt_token_ids[1]"]),
        ({"prompt_token_ids": [5] * 64}, ["prompt_token_ids"]),
        ({"prompt_token_ids": [5] * 60, "max_tokens": 5}, ["max_tokens"]),
        ({"max_tokens": 0}, ["max_tokens"]),
        ({"min_tokens": 9}, ["min_tokens"]),
        ({"stop_token_ids": [3, 600]}, ["stop_token_ids[1]"]),
        ({"logprobs": 21}, ["logprobs"]),
        ({"sampling": {"temperature": 2.5}}, ["sampling.temperature"]),
        ({"sampling": {"temperature": float("nan")}}, ["sampling.temperature"]),
        ({"sampling": {"top_p": 1.5}}, ["sampling.top_p"]),
        ({"sampling": {"top_k": -3}}, ["sampling.top_k"]),
        ({"sampling": {"min_p": -0.1}}, ["sampling.min_p"]),
        ({"sampling": {"repetition_penalty": 0.0}}, ["sampling.repetition_penalty"]),
        ({"sampling": {"frequency_penalty": -2.5}}, ["sampling.frequency_penalty"]),
        (
            {"prompt_token_ids": [], "sampling": {"temperature": -1.0}},
            ["prompt_token_ids", "sampling.temperature"],
        ),
    ],
)
def test_invalid_fields_are_named(fields: dict[str, Any], expected: list[str]) -> None:
    assert violated_fields(request(**fields)) == expected


def test_invalid_argument_becomes_a_bad_request_status() -> None:
    from google.rpc import code_pb2, error_details_pb2, status_pb2

    with pytest.raises(InvalidArgument) as err:
        parse_generate(request(max_tokens=0), INFO)
    ((key, raw),) = err.value.trailers()
    assert key == "grpc-status-details-bin"
    status = status_pb2.Status.FromString(raw)
    assert status.code == code_pb2.INVALID_ARGUMENT
    bad = error_details_pb2.BadRequest()
    assert status.details[0].Unpack(bad)
    assert [v.field for v in bad.field_violations] == ["max_tokens"]
