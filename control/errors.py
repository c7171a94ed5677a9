"""The control plane's typed errors.

Every failure a client can see is raised as a `SwitchyardError` subclass somewhere in the
request path; the servicers turn it into a status with rich details through the one table
in `control.api.status`.
"""

from __future__ import annotations

from switchyard_common.rpc_status import FieldViolation

__all__ = [
    "AdapterNotFound",
    "AlreadyExists",
    "FieldViolation",
    "Internal",
    "InvalidArgument",
    "LoadFailed",
    "ModelNotFound",
    "NoHealthyWorker",
    "NotFound",
    "NotResumable",
    "Overloaded",
    "SwitchyardError",
    "WorkerFailed",
]


class SwitchyardError(Exception):
    """Base of every error the control plane reports to a client."""


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


class NotResumable(SwitchyardError):
    """A stream whose worker failed after its first token cannot go on elsewhere without
    breaking what the request asked for (its constraint): UNAVAILABLE, with how many
    tokens the caller has and why."""

    def __init__(self, tokens: int, failure: str, why: str) -> None:
        self.tokens = tokens
        super().__init__(
            f"the stream was interrupted after {tokens} tokens ({failure}) and cannot be "
            f"resumed: {why}"
        )


class WorkerFailed(SwitchyardError):
    """The worker (named in the message) failed in a way the client must hear about."""

    def __init__(self, worker: str, message: str) -> None:
        self.worker = worker
        super().__init__(f"worker {worker}: {message}")


class AlreadyExists(SwitchyardError):
    pass


class NotFound(SwitchyardError):
    """An operator named something that is not there (a model to unload, a worker)."""


class AdapterNotFound(NotFound):
    """A request (or UnloadAdapter) named a LoRA adapter the model does not hold."""

    def __init__(self, model: str, adapter: str, known: list[str] | None) -> None:
        self.adapter = adapter
        held = "" if known is None else f" (it holds: {', '.join(known) or 'none'})"
        super().__init__(f"model {model!r} holds no adapter {adapter!r}{held}")


class LoadFailed(SwitchyardError):
    """A model could not be loaded; the message has the cause, not a wrapper."""


class Internal(SwitchyardError):
    """A fault of the control plane itself (a bug): the client hears INTERNAL, with the
    request id, and the log has the traceback."""


class Unauthenticated(SwitchyardError):
    """No bearer token, or one that is not in the tokens file."""


class PermissionDenied(SwitchyardError):
    """A known token without the scope, or the model, that the call needs."""


class FailedPrecondition(SwitchyardError):
    """The request needs something the model does not have (a chat template, a feature
    its engine lacks); the message names what, and `field` the request's field."""

    def __init__(self, message: str, field: str | None = None) -> None:
        self.field = field
        super().__init__(message)
