"""The control plane's typed errors and the one table that maps them to gRPC statuses.

Every failure a client can see is raised as a `SwitchyardError` subclass somewhere in the
request path; the servicer turns it into a status with rich details
(`google.rpc.Status` in the `grpc-status-details-bin` trailer) through `to_rpc_status`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NoReturn

import grpc
from google.protobuf import duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2

DETAILS_KEY = "grpc-status-details-bin"


@dataclass(frozen=True, slots=True)
class FieldViolation:
    field: str
    description: str


class SwitchyardError(Exception):
    """Base of every error the control plane reports to a client."""

    def details(self) -> list[status_pb2.Status]:  # pragma: no cover - overridden
        return []


class InvalidArgument(SwitchyardError):
    def __init__(self, violations: list[FieldViolation]) -> None:
        self.violations = violations
        super().__init__("; ".join(f"{v.field}: {v.description}" for v in violations))

    @classmethod
    def one(cls, field: str, description: str) -> InvalidArgument:
        return cls([FieldViolation(field, description)])


class ModelNotFound(SwitchyardError):
    def __init__(self, model: str, known: list[str]) -> None:
        self.model = model
        super().__init__(f"model {model!r} is not served here; known models: {', '.join(known)}")


class Overloaded(SwitchyardError):
    def __init__(self, message: str, retry_after_s: float) -> None:
        self.retry_after_s = retry_after_s
        super().__init__(message)


class NoHealthyWorker(SwitchyardError):
    pass


class WorkerFailed(SwitchyardError):
    """The worker (named in the message) failed in a way the client must hear about."""

    def __init__(self, worker: str, message: str) -> None:
        self.worker = worker
        super().__init__(f"worker {worker}: {message}")


class AlreadyExists(SwitchyardError):
    pass


class NotFound(SwitchyardError):
    """An operator named something that is not there (a model to unload, a worker)."""


class LoadFailed(SwitchyardError):
    pass


_CODES: dict[type[SwitchyardError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    ModelNotFound: grpc.StatusCode.NOT_FOUND,
    Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    NoHealthyWorker: grpc.StatusCode.UNAVAILABLE,
    WorkerFailed: grpc.StatusCode.INTERNAL,
    AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    NotFound: grpc.StatusCode.NOT_FOUND,
    LoadFailed: grpc.StatusCode.FAILED_PRECONDITION,
}


def status_code(err: SwitchyardError) -> grpc.StatusCode:
    for cls in type(err).__mro__:
        code = _CODES.get(cls)
        if code is not None:
            return code
    return grpc.StatusCode.INTERNAL


def to_rpc_status(
    err: SwitchyardError,
) -> tuple[grpc.StatusCode, str, tuple[tuple[str, bytes], ...]]:
    """(code, message, trailing metadata with the rich google.rpc.Status)."""
    code = status_code(err)
    message = str(err)
    status = status_pb2.Status(code=_rpc_code(code), message=message)
    if isinstance(err, InvalidArgument):
        bad = error_details_pb2.BadRequest(
            field_violations=[
                error_details_pb2.BadRequest.FieldViolation(
                    field=v.field, description=v.description
                )
                for v in err.violations
            ]
        )
        status.details.add().Pack(bad)
    elif isinstance(err, Overloaded):
        delay = duration_pb2.Duration()
        delay.FromMilliseconds(max(1, int(err.retry_after_s * 1000)))
        status.details.add().Pack(error_details_pb2.RetryInfo(retry_delay=delay))
    elif isinstance(err, ModelNotFound):
        info = error_details_pb2.ResourceInfo(resource_type="model", resource_name=err.model)
        status.details.add().Pack(info)
    return code, message, ((DETAILS_KEY, status.SerializeToString()),)


def _rpc_code(code: grpc.StatusCode) -> int:
    value: int = code.value[0]
    return value if value in code_pb2.Code.values() else code_pb2.UNKNOWN


async def abort_rpc(context: Any, err: SwitchyardError) -> NoReturn:
    """End the RPC with `err`'s status from the table above, rich details included."""
    code, message, trailers = to_rpc_status(err)
    await context.abort(code, message, trailing_metadata=trailers)
    raise AssertionError("unreachable")  # context.abort raises
