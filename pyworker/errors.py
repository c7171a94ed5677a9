"""The worker's error hierarchy and its one mapping to gRPC status codes.

Handlers raise `WorkerError` subclasses; each class names its code, and `abort_with()`
turns one into a gRPC status with rich details built the same way as the control plane's
(`switchyard_common.rpc_status`).
"""

from __future__ import annotations

from typing import Any, NoReturn

import grpc

from switchyard_common.rpc_status import FieldViolation, Trailers, status_trailers

__all__ = [
    "AlreadyExists",
    "EngineFailure",
    "FailedPrecondition",
    "FieldViolation",
    "InvalidArgument",
    "NotFound",
    "Overloaded",
    "Unavailable",
    "WorkerError",
    "abort_with",
    "status_trailers_of",
]


class WorkerError(Exception):
    """Base of every error a worker RPC reports to its caller."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    violations: tuple[FieldViolation, ...] = ()

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(WorkerError):
    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, violations: list[FieldViolation]) -> None:
        if not violations:
            raise ValueError("InvalidArgument needs at least one violation")
        message = "; ".join(f"{v.field}: {v.description}" for v in violations)
        super().__init__(message)
        self.violations = tuple(violations)

    @classmethod
    def field(cls, field: str, description: str) -> InvalidArgument:
        return cls([FieldViolation(field, description)])


class AlreadyExists(WorkerError):
    code = grpc.StatusCode.ALREADY_EXISTS


class NotFound(WorkerError):
    """A name the worker does not hold (a LoRA adapter)."""

    code = grpc.StatusCode.NOT_FOUND

    @classmethod
    def field(cls, field: str, description: str) -> NotFound:
        err = cls(description)
        err.violations = (FieldViolation(field, description),)
        return err


class FailedPrecondition(WorkerError):
    """The engine lacks what the call needs (LoRA on an engine started without it)."""

    code = grpc.StatusCode.FAILED_PRECONDITION

    @classmethod
    def field(cls, field: str, description: str) -> FailedPrecondition:
        err = cls(f"{field}: {description}")
        err.violations = (FieldViolation(field, description),)
        return err


class EngineFailure(WorkerError):
    """The engine failed while serving a request (or is dead)."""

    code = grpc.StatusCode.INTERNAL


class Overloaded(WorkerError):
    """The worker holds as many requests as it may; the caller should go elsewhere."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(WorkerError):
    """The worker cannot take requests right now (shutting down, engine dead)."""

    code = grpc.StatusCode.UNAVAILABLE


def status_trailers_of(error: WorkerError) -> Trailers:
    """The rich status of `error`, as trailing metadata."""
    return status_trailers(error.code, error.message, violations=error.violations)


async def abort_with(context: grpc.aio.ServicerContext[Any, Any], error: WorkerError) -> NoReturn:
    """End the RPC with `error`'s code, message and rich details."""
    await context.abort(error.code, error.message, trailing_metadata=status_trailers_of(error))
    raise AssertionError("unreachable")  # context.abort raises
