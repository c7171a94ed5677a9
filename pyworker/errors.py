"""The worker's errors and its one mapping to gRPC statuses.

Handlers raise `StatusError`s (`switchyard_common.status_error`): one of the kinds every
Switchyard server raises (`InvalidArgument`, `NotFound`, `AlreadyExists`, `Overloaded`,
re-exported here) or a `WorkerError`, a kind only the worker raises. Each class names
its code, and `abort_with()` turns one into a gRPC status with rich details built the
same way as the control plane's (`switchyard_common.rpc_status`).
"""

from __future__ import annotations

from typing import Any, NoReturn, Self

import grpc

from switchyard_common.rpc_status import FieldViolation
from switchyard_common.status_error import (
    AlreadyExists,
    InvalidArgument,
    NotFound,
    Overloaded,
    StatusError,
)

__all__ = [
    "AlreadyExists",
    "EngineFailure",
    "FailedPrecondition",
    "FieldViolation",
    "InvalidArgument",
    "NotFound",
    "Overloaded",
    "StatusError",
    "Unavailable",
    "WorkerError",
    "abort_with",
]


class WorkerError(StatusError):
    """Base of the errors only a worker reports to its caller. To catch every error a
    worker RPC can report, catch `StatusError`: the kinds shared with the control plane
    are not `WorkerError`s."""


class FailedPrecondition(WorkerError):
    """The engine lacks what the call needs (LoRA on an engine started without it).
    Not the control plane's kind of the same code: this one names its field in a
    BadRequest, as the control plane reads a worker's refusals."""

    code = grpc.StatusCode.FAILED_PRECONDITION

    @classmethod
    def for_field(cls, field: str, description: str) -> Self:
        return cls(f"{field}: {description}", violations=[FieldViolation(field, description)])


class EngineFailure(WorkerError):
    """The engine failed while serving a request (or is dead)."""

    code = grpc.StatusCode.INTERNAL


class Unavailable(WorkerError):
    """The worker cannot take requests right now (shutting down, engine dead)."""

    code = grpc.StatusCode.UNAVAILABLE


async def abort_with(context: grpc.aio.ServicerContext[Any, Any], error: StatusError) -> NoReturn:
    """End the RPC with `error`'s code, message and rich details."""
    await context.abort(error.code, error.message, trailing_metadata=error.trailers())
    raise AssertionError("unreachable")  # context.abort raises
