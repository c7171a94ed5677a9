"""The control plane's errors as a client hears them: each kind's status code, message
and rich details, exactly those the control plane sent before its errors moved onto the
shared `StatusError` base (the expected trailers are built the old way, argument by
argument). Starts nothing."""

from __future__ import annotations

import grpc
import pytest

from control.api.status import to_rpc_status
from control.errors import (
    AdapterNotFound,
    AlreadyExists,
    FailedPrecondition,
    FieldViolation,
    Internal,
    InvalidArgument,
    LoadFailed,
    ModelNotFound,
    NoHealthyWorker,
    NotFound,
    NotResumable,
    Overloaded,
    PermissionDenied,
    ServiceError,
    StatusError,
    Unauthenticated,
    WorkerFailed,
)
from switchyard_common.rpc_status import status_trailers

Code = grpc.StatusCode
V = [FieldViolation("stopping.max_tokens", "too many")]
CASES: list[tuple[StatusError, Code, dict[str, object]]] = [
    (InvalidArgument(V), Code.INVALID_ARGUMENT, {"violations": V}),
    (ModelNotFound("m", ["a", "b"]), Code.NOT_FOUND, {"resource": ("model", "m")}),
    (Overloaded("busy", 0.5), Code.RESOURCE_EXHAUSTED, {"retry_after_s": 0.5}),
    (Overloaded("busy", 0.0), Code.RESOURCE_EXHAUSTED, {"retry_after_s": 0.0}),
    (NoHealthyWorker("none"), Code.UNAVAILABLE, {}),
    (NotResumable(3, "lost", "constraint"), Code.UNAVAILABLE, {}),
    (WorkerFailed("w:1", "boom"), Code.INTERNAL, {}),
    (AlreadyExists("there"), Code.ALREADY_EXISTS, {}),
    (NotFound("gone"), Code.NOT_FOUND, {}),
    (AdapterNotFound("m", "x", ["y"]), Code.NOT_FOUND, {"resource": ("adapter", "x")}),
    (LoadFailed("no"), Code.FAILED_PRECONDITION, {}),
    (Internal("bug"), Code.INTERNAL, {}),
    (Unauthenticated("who"), Code.UNAUTHENTICATED, {}),
    (PermissionDenied("no"), Code.PERMISSION_DENIED, {}),
    (FailedPrecondition("no template"), Code.FAILED_PRECONDITION, {}),
    (
        FailedPrecondition("beam_width: no beams", field="beam_width"),
        Code.FAILED_PRECONDITION,
        {"precondition": ("capability", "beam_width", "beam_width: no beams")},
    ),
]


@pytest.mark.parametrize(("err", "code", "details"), CASES)
def test_status_is_as_before(err: StatusError, code: Code, details: dict[str, object]) -> None:
    got_code, message, trailers = to_rpc_status(err)
    assert got_code == code
    assert message == str(err)
    assert trailers == status_trailers(code, message, **details)  # type: ignore[arg-type]


def test_messages_are_as_before() -> None:
    assert str(ModelNotFound("m", ["a", "b"])) == "model 'm' is not served here; known models: a, b"
    assert str(AdapterNotFound("m", "x", [])) == "model 'm' holds no adapter 'x' (it holds: none)"
    assert str(AdapterNotFound("m", "x", None)) == "model 'm' holds no adapter 'x'"
    assert str(WorkerFailed("w:1", "boom")) == "worker w:1: boom"
    assert str(InvalidArgument(V)) == "stopping.max_tokens: too many"


def test_only_the_control_planes_own_kinds_are_service_errors() -> None:
    assert isinstance(ModelNotFound("m", []), ServiceError)
    assert not isinstance(InvalidArgument(V), ServiceError)  # shared with the worker
    assert isinstance(InvalidArgument(V), StatusError)
