"""The control plane's one table from errors to gRPC statuses, with rich details
(`google.rpc.Status` in the `grpc-status-details-bin` trailer)."""

from __future__ import annotations

from typing import Any, NoReturn

import grpc

from control.errors import (
    AdapterNotFound,
    AlreadyExists,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    LoadFailed,
    ModelNotFound,
    NoHealthyWorker,
    NotFound,
    NotResumable,
    Overloaded,
    PermissionDenied,
    SwitchyardError,
    Unauthenticated,
    WorkerFailed,
)
from switchyard_common.rpc_status import Trailers, status_trailers

_CODES: dict[type[SwitchyardError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    ModelNotFound: grpc.StatusCode.NOT_FOUND,
    Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    NoHealthyWorker: grpc.StatusCode.UNAVAILABLE,
    NotResumable: grpc.StatusCode.UNAVAILABLE,
    WorkerFailed: grpc.StatusCode.INTERNAL,
    AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    NotFound: grpc.StatusCode.NOT_FOUND,
    LoadFailed: grpc.StatusCode.FAILED_PRECONDITION,
    Internal: grpc.StatusCode.INTERNAL,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
}


def status_code(err: SwitchyardError) -> grpc.StatusCode:
    for cls in type(err).__mro__:
        code = _CODES.get(cls)
        if code is not None:
            return code
    return grpc.StatusCode.INTERNAL


def to_rpc_status(err: SwitchyardError) -> tuple[grpc.StatusCode, str, Trailers]:
    """(code, message, trailing metadata with the rich google.rpc.Status)."""
    code = status_code(err)
    message = str(err)
    if isinstance(err, InvalidArgument):
        return code, message, status_trailers(code, message, violations=err.violations)
    if isinstance(err, Overloaded):
        return code, message, status_trailers(code, message, retry_after_s=err.retry_after_s)
    if isinstance(err, FailedPrecondition) and err.field is not None:
        precondition = ("capability", err.field, message)
        return code, message, status_trailers(code, message, precondition=precondition)
    if isinstance(err, ModelNotFound):
        return code, message, status_trailers(code, message, resource=("model", err.model))
    if isinstance(err, AdapterNotFound):
        return code, message, status_trailers(code, message, resource=("adapter", err.adapter))
    return code, message, status_trailers(code, message)


async def abort_rpc(context: Any, err: SwitchyardError) -> NoReturn:
    """End the RPC with `err`'s status from the table above, rich details included."""
    code, message, trailers = to_rpc_status(err)
    await context.abort(code, message, trailing_metadata=trailers)
    raise AssertionError("unreachable")  # context.abort raises
