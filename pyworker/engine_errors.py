"""What an engine error means for the caller: vLLM's own error classes say whether a
request was the client's fault (naming the field where they can), hit a full engine, or
met an engine fault; `describe` turns an exception chain into one line."""

from __future__ import annotations

from pyworker.errors import EngineFailure, InvalidArgument, Overloaded, StatusError


def refusal(exc: BaseException, unnamed_field: str | None = None) -> StatusError:
    """What the caller hears of an engine error before the request's first token: its
    own fault naming the field (`unnamed_field` where vLLM names none), a full engine, or
    an engine failure."""
    if isinstance(exc, StatusError):  # already said (a check of the worker's own)
        return exc
    kind = classify(exc)
    message = describe(exc)
    if kind is InvalidArgument:
        field = client_field(exc)
        if field == "request" and unnamed_field:
            field = unnamed_field
        return InvalidArgument.for_field(field, message)
    if kind is Overloaded:
        return Overloaded(f"the engine is full: {message}")
    return EngineFailure(f"engine error: {message}")


def classify(exc: BaseException) -> type[StatusError] | None:
    """What vLLM's own error says about the request: the client's fault (its
    `VLLMClientError` family), a full engine (queue or prefill backlog limits), or
    nothing (an engine fault). Releases without `vllm.exceptions` say nothing, and a bare
    ValueError from inside the engine is an engine fault, not the client's."""
    try:
        from vllm import exceptions as vllm_errors
    except ImportError:  # older releases
        return None
    client = getattr(vllm_errors, "VLLMClientError", None)
    full = tuple(
        cls
        for name in ("QueueOverflowError", "MaxQueuedTokensError")
        if isinstance(cls := getattr(vllm_errors, name, None), type)
    )
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(client, type) and isinstance(cause, client):
            return InvalidArgument
        if full and isinstance(cause, full):
            return Overloaded
        cause = cause.__cause__
    return None


def client_field(exc: BaseException) -> str:
    cause: BaseException | None = exc
    while cause is not None:
        parameter = getattr(cause, "parameter", None)
        if parameter:
            return str(parameter)
        cause = cause.__cause__
    return "request"


def describe(exc: BaseException) -> str:
    cause = exc.__cause__
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if cause is not None and cause is not exc:
        text += f" (caused by {describe(cause)})"
    return text
