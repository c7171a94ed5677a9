"""The worker's error hierarchy and its one mapping to gRPC status codes.

Handlers raise `WorkerError` subclasses; `abort_with()` turns one into a gRPC status
with rich details (`google.rpc.Status`, sent as `grpc-status-details-bin`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NoReturn

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2


@dataclass(frozen=True)
class FieldViolation:
    field: str
    description: str


class WorkerError(Exception):
    """Base of every error a worker RPC reports to its caller."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def details(self) -> list[Any]:
        """Protobuf messages packed into google.rpc.Status.details."""
        return []


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

    def details(self) -> list[Any]:
        bad_request = error_details_pb2.BadRequest(
            field_violations=[
                error_details_pb2.BadRequest.FieldViolation(
                    field=v.field, description=v.description
                )
                for v in self.violations
            ]
        )
        return [bad_request]


class AlreadyExists(WorkerError):
    code = grpc.StatusCode.ALREADY_EXISTS


class EngineFailure(WorkerError):
    """The engine failed while serving a request (or is dead)."""

    code = grpc.StatusCode.INTERNAL


class Unavailable(WorkerError):
    """The worker cannot take requests right now (shutting down, engine dead)."""

    code = grpc.StatusCode.UNAVAILABLE


# The single table from gRPC status codes to google.rpc codes (numerically equal,
# but spelled out so the mapping is explicit).
_RPC_CODES: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.INVALID_ARGUMENT: code_pb2.INVALID_ARGUMENT,
    grpc.StatusCode.ALREADY_EXISTS: code_pb2.ALREADY_EXISTS,
    grpc.StatusCode.INTERNAL: code_pb2.INTERNAL,
    grpc.StatusCode.UNAVAILABLE: code_pb2.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: code_pb2.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED: code_pb2.CANCELLED,
}


def to_rpc_status(error: WorkerError) -> status_pb2.Status:
    details = []
    for message in error.details():
        packed = any_pb2.Any()
        packed.Pack(message)
        details.append(packed)
    return status_pb2.Status(
        code=_RPC_CODES.get(error.code, code_pb2.UNKNOWN),
        message=error.message,
        details=details,
    )


async def abort_with(context: grpc.aio.ServicerContext[Any, Any], error: WorkerError) -> NoReturn:
    """End the RPC with `error`'s code, message and rich details."""
    status = to_rpc_status(error)
    await context.abort(
        error.code,
        error.message,
        trailing_metadata=(("grpc-status-details-bin", status.SerializeToString()),),
    )
