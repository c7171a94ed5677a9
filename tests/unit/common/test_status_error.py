"""The shared status-error base (`switchyard_common.status_error`): each kind's code,
message and rich details survive the trip through the `grpc-status-details-bin`
trailer, as `rpc_status` and the client library read them back; the single-field helper
names its field. Starts nothing."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from switchyard.client import errors as client_errors
from switchyard_common.rpc_status import (
    DETAILS_KEY,
    FieldViolation,
    read_details,
    rpc_code,
)
from switchyard_common.status_error import (
    AlreadyExists,
    InvalidArgument,
    NotFound,
    Overloaded,
    StatusError,
)


class FakeRpcError:
    """What a caller's stub raises for `err`'s status, as the client library reads it."""

    def __init__(self, err: StatusError) -> None:
        self._err = err

    def code(self) -> grpc.StatusCode:
        return self._err.code

    def details(self) -> str:
        return self._err.message

    def trailing_metadata(self) -> Any:
        return self._err.trailers()


def status_of(err: StatusError) -> status_pb2.Status:
    ((key, raw),) = err.trailers()
    assert key == DETAILS_KEY
    return status_pb2.Status.FromString(raw)


KINDS: list[tuple[StatusError, grpc.StatusCode, str]] = [
    (
        InvalidArgument([FieldViolation("a", "bad"), FieldViolation("b.c[1]", "worse")]),
        grpc.StatusCode.INVALID_ARGUMENT,
        "a: bad; b.c[1]: worse",
    ),
    (NotFound("no such thing"), grpc.StatusCode.NOT_FOUND, "no such thing"),
    (AlreadyExists("already there"), grpc.StatusCode.ALREADY_EXISTS, "already there"),
    (Overloaded("full", 0.25), grpc.StatusCode.RESOURCE_EXHAUSTED, "full"),
    (Overloaded("full, no hint"), grpc.StatusCode.RESOURCE_EXHAUSTED, "full, no hint"),
    (StatusError("a fault"), grpc.StatusCode.INTERNAL, "a fault"),
]


@pytest.mark.parametrize(("err", "code", "message"), KINDS)
def test_code_message_and_details_survive_the_trailer(
    err: StatusError, code: grpc.StatusCode, message: str
) -> None:
    assert err.code == code and err.message == message == str(err)
    status = status_of(err)
    assert status.code == rpc_code(code) and status.message == message
    details = read_details(err.trailers())
    assert details.violations == err.violations
    assert details.retry_after_s == err.retry_after_s


@pytest.mark.parametrize(("err", "code", "message"), KINDS)
def test_the_client_reads_back_what_was_sent(
    err: StatusError, code: grpc.StatusCode, message: str
) -> None:
    heard = client_errors.from_rpc_error(FakeRpcError(err))
    assert heard.code == code and heard.message == message
    assert [(v.field, v.description) for v in heard.violations] == [
        (v.field, v.description) for v in err.violations
    ]
    assert heard.retry_after_s == err.retry_after_s
    assert heard.resource == err.resource


def test_only_the_details_a_kind_has_are_sent() -> None:
    assert len(status_of(AlreadyExists("x")).details) == 0
    assert len(status_of(Overloaded("x")).details) == 0  # no RetryInfo without a hint
    retry = error_details_pb2.RetryInfo()
    ((only,),) = [status_of(Overloaded("x", 1.5)).details]
    assert only.Unpack(retry) and retry.retry_delay.ToMilliseconds() == 1500


def test_invalid_argument_for_field_names_its_field() -> None:
    err = InvalidArgument.for_field("sampling.top_p", "must be in (0, 1]")
    assert err.violations == (FieldViolation("sampling.top_p", "must be in (0, 1]"),)
    assert err.message == "sampling.top_p: must be in (0, 1]"
    bad = error_details_pb2.BadRequest()
    assert status_of(err).details[0].Unpack(bad)
    assert [(v.field, v.description) for v in bad.field_violations] == [
        ("sampling.top_p", "must be in (0, 1]")
    ]


def test_not_found_for_field_names_its_field_and_says_the_description() -> None:
    err = NotFound.for_field("adapter", "adapter 'x' is not loaded")
    assert err.code == grpc.StatusCode.NOT_FOUND
    assert err.message == "adapter 'x' is not loaded"
    assert read_details(err.trailers()).violations == (
        FieldViolation("adapter", "adapter 'x' is not loaded"),
    )


def test_invalid_argument_needs_a_violation() -> None:
    with pytest.raises(ValueError, match="at least one violation"):
        InvalidArgument([])


def test_resource_and_precondition_details_survive() -> None:
    err = StatusError(
        "m", resource=("model", "tiny"), precondition=("capability", "beam_width", "m")
    )
    heard = client_errors.from_rpc_error(FakeRpcError(err))
    assert heard.resource == ("model", "tiny")
    assert [(v.field, v.description) for v in heard.violations] == [("beam_width", "m")]
