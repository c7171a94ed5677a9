"""The one status-error base of every Switchyard server, and the kinds both raise.

A `StatusError` is a failure a server reports as a gRPC status: its class names the
status code, and it carries the message and the rich details (`google.rpc.Status` in the
`grpc-status-details-bin` trailer, built by `switchyard_common.rpc_status`): the fields a
request got wrong (`BadRequest`), how long to wait before trying again (`RetryInfo`), the
resource it named (`ResourceInfo`), the precondition it failed (`PreconditionFailure`).

The control plane (`control.errors.ServiceError`) and the worker
(`pyworker.errors.WorkerError`) build on it with the kinds only they raise; the kinds
below are the ones both raise, defined once. Each kind has at most one helper, the same
name everywhere: `for_field(field, description)`, the error about one request field.

(The client library's errors, `switchyard.client.errors.SwitchyardError`, are what a
caller reads back from such a status; they stand alone and do not build on this.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, Self

import grpc

from switchyard_common.rpc_status import FieldViolation, Trailers, status_trailers

__all__ = [
    "AlreadyExists",
    "FieldViolation",
    "InvalidArgument",
    "NotFound",
    "Overloaded",
    "StatusError",
]


class StatusError(Exception):
    """A failure reported as a gRPC status: `code` (named by each class), `message` (what
    the caller reads as the status's details) and the rich details, each empty unless
    the kind has it."""

    code: ClassVar[grpc.StatusCode] = grpc.StatusCode.INTERNAL

    def __init__(
        self,
        message: str,
        *,
        violations: Sequence[FieldViolation] = (),
        retry_after_s: float | None = None,
        resource: tuple[str, str] | None = None,
        precondition: tuple[str, str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.violations: tuple[FieldViolation, ...] = tuple(violations)  # BadRequest
        self.retry_after_s = retry_after_s  # RetryInfo
        self.resource = resource  # ResourceInfo: (type, name)
        self.precondition = precondition  # PreconditionFailure: (type, subject, description)

    def trailers(self) -> Trailers:
        """The rich status of this error, as trailing metadata."""
        return status_trailers(
            self.code,
            self.message,
            violations=self.violations,
            retry_after_s=self.retry_after_s,
            resource=self.resource,
            precondition=self.precondition,
        )


class InvalidArgument(StatusError):
    """The request is wrong, field by field (at least one); the message lists them."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, violations: Sequence[FieldViolation]) -> None:
        if not violations:
            raise ValueError("InvalidArgument needs at least one violation")
        message = "; ".join(f"{v.field}: {v.description}" for v in violations)
        super().__init__(message, violations=violations)

    @classmethod
    def for_field(cls, field: str, description: str) -> Self:
        """The request's `field` is wrong, and `description` says why."""
        return cls([FieldViolation(field, description)])


class NotFound(StatusError):
    """The request named something that is not there (a model, an adapter, a worker)."""

    code = grpc.StatusCode.NOT_FOUND

    @classmethod
    def for_field(cls, field: str, description: str) -> Self:
        """What the request's `field` names is not there; `description` is the message,
        and the field is sent as a BadRequest violation."""
        return cls(description, violations=[FieldViolation(field, description)])


class AlreadyExists(StatusError):
    """The request would create something that is already there (or being made)."""

    code = grpc.StatusCode.ALREADY_EXISTS


class Overloaded(StatusError):
    """The server holds as much as it may: RESOURCE_EXHAUSTED, with a RetryInfo when
    `retry_after_s` is given."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
