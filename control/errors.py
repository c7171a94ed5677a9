"""The control plane's typed errors.

Every failure a client can see is raised as a `StatusError`
(`switchyard_common.status_error`) somewhere in the request path: one of the kinds both
servers raise (`InvalidArgument`, `NotFound`, `AlreadyExists`, `Overloaded`, re-exported
here) or a `ServiceError`, a kind only the control plane raises. Each class names its
status code; the servicers turn an error into its status, rich details included, in one
place, `control.api.status`.
"""

from __future__ import annotations

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
    "AdapterNotFound",
    "AlreadyExists",
    "FailedPrecondition",
    "FieldViolation",
    "Internal",
    "InvalidArgument",
    "LoadFailed",
    "ModelNotFound",
    "NoHealthyWorker",
    "NotFound",
    "NotResumable",
    "Overloaded",
    "PermissionDenied",
    "ServiceError",
    "StatusError",
    "Unauthenticated",
    "WorkerFailed",
]


class ServiceError(StatusError):
    """Base of the errors only the control plane (the service clients call) reports.

    Named for the service, not `SwitchyardError`: that name is the client library's
    (`switchyard.client.errors.SwitchyardError`, what a caller reads back from these).
    To catch every error a client can hear, catch `StatusError`: the kinds shared with
    the worker are not `ServiceError`s."""


class ModelNotFound(ServiceError):
    """A request named a model not served here; the ResourceInfo names it."""

    code = grpc.StatusCode.NOT_FOUND

    def __init__(self, model: str, known: list[str]) -> None:
        self.model = model
        super().__init__(
            f"model {model!r} is not served here; known models: {', '.join(known)}",
            resource=("model", model),
        )


class NoHealthyWorker(ServiceError):
    code = grpc.StatusCode.UNAVAILABLE


class NotResumable(ServiceError):
    """A stream whose worker failed after its first token cannot go on elsewhere without
    breaking what the request asked for (its constraint): UNAVAILABLE, with how many
    tokens the caller has and why."""

    code = grpc.StatusCode.UNAVAILABLE

    def __init__(self, tokens: int, failure: str, why: str) -> None:
        self.tokens = tokens
        super().__init__(
            f"the stream was interrupted after {tokens} tokens ({failure}) and cannot be "
            f"resumed: {why}"
        )


class WorkerFailed(ServiceError):
    """The worker (named in the message) failed in a way the client must hear about."""

    code = grpc.StatusCode.INTERNAL

    def __init__(self, worker: str, message: str) -> None:
        self.worker = worker
        super().__init__(f"worker {worker}: {message}")


class AdapterNotFound(NotFound):
    """A request (or UnloadAdapter) named a LoRA adapter the model does not hold; the
    ResourceInfo names it."""

    def __init__(self, model: str, adapter: str, known: list[str] | None) -> None:
        self.adapter = adapter
        held = "" if known is None else f" (it holds: {', '.join(known) or 'none'})"
        super().__init__(
            f"model {model!r} holds no adapter {adapter!r}{held}",
            resource=("adapter", adapter),
        )


class LoadFailed(ServiceError):
    """A model could not be loaded; the message has the cause, not a wrapper."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Internal(ServiceError):
    """A fault of the control plane itself (a bug): the client hears INTERNAL, with the
    request id, and the log has the traceback."""

    code = grpc.StatusCode.INTERNAL


class Unauthenticated(ServiceError):
    """No bearer token, or one that is not in the tokens file."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(ServiceError):
    """A known token without the scope, or the model, that the call needs."""

    code = grpc.StatusCode.PERMISSION_DENIED


class FailedPrecondition(ServiceError):
    """The request needs something the model does not have (a chat template, a feature
    its engine lacks); the message names what, and `field` the request's field, sent as
    a PreconditionFailure (type "capability"). Not the worker's kind of the same code,
    which names its field in a BadRequest."""

    code = grpc.StatusCode.FAILED_PRECONDITION

    def __init__(self, message: str, field: str | None = None) -> None:
        self.field = field
        precondition = None if field is None else ("capability", field, message)
        super().__init__(message, precondition=precondition)
