"""Validation at the edge: every bad field is named, good requests become typed values."""

from __future__ import annotations

import math

import pytest
from switchyard.v1 import common_pb2, generation_pb2

from control.api.status import to_rpc_status
from control.errors import InvalidArgument
from control.text.params import ModelLimits, parse_request


def req(**kw: object) -> generation_pb2.GenerateRequest:
    base: dict[str, object] = {"model": "tiny", "text": "Hello"}
    base.update(kw)
    return generation_pb2.GenerateRequest(**base)  # type: ignore[arg-type]


def fields_of(r: generation_pb2.GenerateRequest) -> list[str]:
    with pytest.raises(InvalidArgument) as info:
        parse_request(r)
    return [v.field for v in info.value.violations]


def test_valid_request_becomes_typed_values() -> None:
    p = parse_request(
        req(
            sampling=common_pb2.SamplingParams(temperature=0.5, top_k=4, seed=3),
            stopping=generation_pb2.StoppingParams(max_tokens=9, stop=["\n"], ignore_eos=True),
            output=generation_pb2.OutputOptions(logprobs=2),
            request_id="abc",
        )
    )
    assert p.sampling.temperature == 0.5 and p.sampling.top_k == 4 and p.sampling.seed == 3
    assert p.sampling.top_p is None  # unset stays unset, not 0
    assert p.max_tokens == 9 and p.stop == ("\n",) and p.ignore_eos
    assert p.logprobs == 2 and p.request_id == "abc" and p.skip_special_tokens


def test_request_id_is_generated_when_empty() -> None:
    a, b = parse_request(req()), parse_request(req())
    assert a.request_id and a.request_id != b.request_id


@pytest.mark.parametrize(
    ("sampling", "field"),
    [
        ({"temperature": -0.1}, "sampling.temperature"),
        ({"temperature": math.nan}, "sampling.temperature"),
        ({"top_p": 0.0}, "sampling.top_p"),
        ({"top_p": 1.01}, "sampling.top_p"),
        ({"top_k": -2}, "sampling.top_k"),
        ({"min_p": 1.5}, "sampling.min_p"),
        ({"repetition_penalty": 0.0}, "sampling.repetition_penalty"),
        ({"presence_penalty": 2.5}, "sampling.presence_penalty"),
        ({"frequency_penalty": -3.0}, "sampling.frequency_penalty"),
    ],
)
def test_sampling_ranges(sampling: dict[str, float], field: str) -> None:
    assert fields_of(req(sampling=common_pb2.SamplingParams(**sampling))) == [field]  # type: ignore[arg-type]


def test_every_violation_is_reported_at_once() -> None:
    r = generation_pb2.GenerateRequest(
        sampling=common_pb2.SamplingParams(temperature=-1, top_p=2),
        stopping=generation_pb2.StoppingParams(max_tokens=0, stop=["ok", ""]),
        output=generation_pb2.OutputOptions(logprobs=50),
    )
    assert fields_of(r) == [
        "model",
        "prompt",
        "sampling.temperature",
        "sampling.top_p",
        "stopping.max_tokens",
        "stopping.stop[1]",
        "output.logprobs",
    ]


def test_stream_interval_up_to_its_limit() -> None:
    def interval(n: int) -> generation_pb2.GenerateRequest:
        return req(output=generation_pb2.OutputOptions(stream_interval=n))

    assert parse_request(interval(1024)).stream_interval == 1024
    assert parse_request(interval(0)).stream_interval == 0  # the server's default
    assert fields_of(interval(1025)) == ["output.stream_interval"]


def test_empty_prompts() -> None:
    assert fields_of(req(text="")) == ["text"]
    empty_ids = generation_pb2.GenerateRequest(model="m", token_ids=generation_pb2.TokenIds())
    assert fields_of(empty_ids) == ["token_ids.ids"]


def test_min_tokens_above_max_tokens() -> None:
    stopping = generation_pb2.StoppingParams(max_tokens=3, min_tokens=4)
    assert fields_of(req(stopping=stopping)) == ["stopping.min_tokens"]


def test_model_limits_bind() -> None:
    limits = ModelLimits(max_context=10, vocab_size=100)
    p = parse_request(req())
    assert limits.bind(p, [1, 2, 3]) == 7  # default: the rest of the context
    p = parse_request(req(stopping=generation_pb2.StoppingParams(max_tokens=8)))
    with pytest.raises(InvalidArgument) as info:
        limits.bind(p, [1, 2, 3])
    assert [v.field for v in info.value.violations] == ["stopping.max_tokens"]
    with pytest.raises(InvalidArgument) as info:
        limits.bind(parse_request(req()), list(range(10)))
    assert [v.field for v in info.value.violations] == ["text"]
    ids = parse_request(
        generation_pb2.GenerateRequest(model="m", token_ids=generation_pb2.TokenIds(ids=[1, 100]))
    )
    with pytest.raises(InvalidArgument) as info:
        limits.bind(ids, [1, 100])
    assert [v.field for v in info.value.violations] == ["token_ids.ids[1]"]


def test_rich_status_carries_bad_request() -> None:
    from google.rpc import error_details_pb2, status_pb2

    err = InvalidArgument.for_field("sampling.top_p", "must be in (0, 1]")
    code, message, trailers = to_rpc_status(err)
    assert code.name == "INVALID_ARGUMENT" and "sampling.top_p" in message
    status = status_pb2.Status.FromString(trailers[0][1])
    bad = error_details_pb2.BadRequest()
    assert status.details[0].Unpack(bad)
    assert bad.field_violations[0].field == "sampling.top_p"


def test_documented_size_limits_name_the_field() -> None:
    from control.text.params import MAX_PROMPT_CHARS, MAX_PROMPT_TOKEN_IDS, MAX_STOP_TOKEN_IDS

    assert fields_of(req(text="x" * (MAX_PROMPT_CHARS + 1))) == ["text"]
    ids = generation_pb2.TokenIds(ids=[1] * (MAX_PROMPT_TOKEN_IDS + 1))
    assert fields_of(req(text=None, token_ids=ids)) == ["token_ids.ids"]
    many_ids = generation_pb2.StoppingParams(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1)))
    assert fields_of(req(stopping=many_ids)) == ["stopping.stop_token_ids"]
    # Ten thousand empty stop strings: one violation for the count and the first few
    # named, not ten thousand.
    many_stops = generation_pb2.StoppingParams(stop=[""] * 10_000)
    names = fields_of(req(stopping=many_stops))
    assert names[0] == "stopping.stop" and len(names) <= 17
