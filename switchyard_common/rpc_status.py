"""One way of building and reading `google.rpc.Status` details for every Switchyard
server: field violations (`BadRequest`), retry hints (`RetryInfo`) and the resource a
request named (`ResourceInfo`), sent in the `grpc-status-details-bin` trailer as
grpcio-status reads them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2

DETAILS_KEY = "grpc-status-details-bin"
Trailers = tuple[tuple[str, bytes], ...]


@dataclass(frozen=True, slots=True)
class FieldViolation:
    field: str
    description: str


def rpc_code(code: grpc.StatusCode) -> int:
    """The google.rpc code of a gRPC status code (numerically equal where both exist)."""
    value: int = code.value[0]
    return value if value in code_pb2.Code.values() else code_pb2.UNKNOWN


def status_trailers(
    code: grpc.StatusCode,
    message: str,
    *,
    violations: Sequence[FieldViolation] = (),
    retry_after_s: float | None = None,
    resource: tuple[str, str] | None = None,
    precondition: tuple[str, str, str] | None = None,
) -> Trailers:
    """Trailing metadata carrying the rich status for `code` and `message`;
    `precondition` is a PreconditionFailure's (type, subject, description)."""
    status = status_pb2.Status(code=rpc_code(code), message=message)
    if violations:
        bad = error_details_pb2.BadRequest(
            field_violations=[
                error_details_pb2.BadRequest.FieldViolation(
                    field=v.field, description=v.description
                )
                for v in violations
            ]
        )
        status.details.add().Pack(bad)
    if retry_after_s is not None:
        delay = duration_pb2.Duration()
        delay.FromMilliseconds(max(1, int(retry_after_s * 1000)))
        status.details.add().Pack(error_details_pb2.RetryInfo(retry_delay=delay))
    if resource is not None:
        kind, name = resource
        status.details.add().Pack(
            error_details_pb2.ResourceInfo(resource_type=kind, resource_name=name)
        )
    if precondition is not None:
        kind, subject, description = precondition
        failure = error_details_pb2.PreconditionFailure(
            violations=[
                error_details_pb2.PreconditionFailure.Violation(
                    type=kind, subject=subject, description=description
                )
            ]
        )
        status.details.add().Pack(failure)
    return ((DETAILS_KEY, status.SerializeToString()),)


@dataclass(frozen=True, slots=True)
class StatusDetails:
    """What a peer's rich status said, read back from its trailers."""

    violations: tuple[FieldViolation, ...] = ()
    retry_after_s: float | None = None


def read_details(trailing_metadata: Any) -> StatusDetails:
    """The details in a call's trailing metadata; empty when there are none or they do
    not parse (a peer that sends no rich status)."""
    raw = None
    for key, value in trailing_metadata or ():
        if key == DETAILS_KEY:
            raw = value
    if not isinstance(raw, bytes):
        return StatusDetails()
    status = status_pb2.Status()
    try:
        status.ParseFromString(raw)
    except Exception:  # a peer's garbage is not our client's problem
        return StatusDetails()
    violations: list[FieldViolation] = []
    retry: float | None = None
    for any_msg in status.details:
        bad = error_details_pb2.BadRequest()
        info = error_details_pb2.RetryInfo()
        if any_msg.Unpack(bad):
            violations += [FieldViolation(v.field, v.description) for v in bad.field_violations]
        elif any_msg.Unpack(info):
            retry = info.retry_delay.ToMilliseconds() / 1000.0
    return StatusDetails(tuple(violations), retry)
