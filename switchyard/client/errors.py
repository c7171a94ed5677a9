"""What a call to Switchyard can fail with, as typed exceptions.

Every gRPC status becomes one `SwitchyardError` subclass, carrying what the server put
in the rich status (`grpc-status-details-bin`): the fields a bad request got wrong, the
delay a busy server asks for, the resource that was not found.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc
from google.rpc import error_details_pb2, status_pb2

__all__ = [
    "Cancelled",
    "DeadlineExceeded",
    "FailedPrecondition",
    "FieldViolation",
    "Internal",
    "InvalidArgument",
    "NotFound",
    "PermissionDenied",
    "ResourceExhausted",
    "SwitchyardError",
    "Unauthenticated",
    "Unavailable",
    "from_rpc_error",
]

_DETAILS_KEY = "grpc-status-details-bin"


@dataclass(frozen=True, slots=True)
class FieldViolation:
    field: str
    description: str


class SwitchyardError(Exception):
    """A call failed; `code` is its gRPC status."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(
        self,
        message: str,
        *,
        code: grpc.StatusCode | None = None,
        violations: tuple[FieldViolation, ...] = (),
        retry_after_s: float | None = None,
        resource: tuple[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        # InvalidArgument: which fields, and why; FailedPrecondition: the fields that ask
        # for what the model's engine lacks.
        self.violations = violations
        self.retry_after_s = retry_after_s  # the server's RetryInfo, if it sent one
        self.resource = resource  # (type, name) of what was not found

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"


class InvalidArgument(SwitchyardError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(SwitchyardError):
    code = grpc.StatusCode.NOT_FOUND


class ResourceExhausted(SwitchyardError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(SwitchyardError):
    code = grpc.StatusCode.UNAVAILABLE


class FailedPrecondition(SwitchyardError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Unauthenticated(SwitchyardError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(SwitchyardError):
    code = grpc.StatusCode.PERMISSION_DENIED


class DeadlineExceeded(SwitchyardError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(SwitchyardError):
    code = grpc.StatusCode.CANCELLED


class Internal(SwitchyardError):
    code = grpc.StatusCode.INTERNAL


_BY_CODE: dict[grpc.StatusCode, type[SwitchyardError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        ResourceExhausted,
        Unavailable,
        FailedPrecondition,
        Unauthenticated,
        PermissionDenied,
        DeadlineExceeded,
        Cancelled,
        Internal,
    )
}


def from_rpc_error(err: Any) -> SwitchyardError:
    """The typed error of a failed call (grpc.RpcError or grpc.aio.AioRpcError)."""
    code: grpc.StatusCode = err.code()
    message = err.details() or ""
    violations: list[FieldViolation] = []
    retry_after: float | None = None
    resource: tuple[str, str] | None = None
    for key, value in err.trailing_metadata() or ():
        if key != _DETAILS_KEY or not isinstance(value, bytes):
            continue
        status = status_pb2.Status.FromString(value)
        for detail in status.details:
            bad, retry, info, precondition = (
                error_details_pb2.BadRequest(),
                error_details_pb2.RetryInfo(),
                error_details_pb2.ResourceInfo(),
                error_details_pb2.PreconditionFailure(),
            )
            if detail.Unpack(bad):
                violations.extend(
                    FieldViolation(v.field, v.description) for v in bad.field_violations
                )
            elif detail.Unpack(retry):
                retry_after = retry.retry_delay.ToMilliseconds() / 1000.0
            elif detail.Unpack(info):
                resource = (info.resource_type, info.resource_name)
            elif detail.Unpack(precondition):  # what the model lacks, by request field
                violations.extend(
                    FieldViolation(v.subject, v.description) for v in precondition.violations
                )
    cls = _BY_CODE.get(code, SwitchyardError)
    return cls(
        message,
        code=code,
        violations=tuple(violations),
        retry_after_s=retry_after,
        resource=resource,
    )
