"""Failover as a policy over the kinds of worker failure.

A request's worker call fails with one `FailureKind` (see `control.workers.call`). The
policy says what the request does next: try another worker (before the first token the
client never notices; after it the new worker resumes from the tokens so far), end the
stream with TIME_LIMIT, or fail.

- LOST, EJECTED: another worker, as long as one remains: the worker is gone or hung, the
  request did nothing wrong.
- OVERLOADED: another worker; with none left the client hears RESOURCE_EXHAUSTED.
- ENGINE: another worker, `max_engine_retries` times per request, so that a request
  that breaks engines cannot take every replica down in turn.
- DEADLINE: the stream ends with TIME_LIMIT.
- REJECTED, SLOW_READER: the request ends; they would fail the same way anywhere.

What the client hears when a request ends on a worker failure is decided here too, and
nowhere else: `client_error` (it failed before any token) and `no_worker_left` (no
worker remains to try).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import grpc

from control.errors import (
    AdapterNotFound,
    FieldViolation,
    InvalidArgument,
    NoHealthyWorker,
    NotResumable,
    Overloaded,
    StatusError,
    WorkerFailed,
)
from control.request.resume import not_resumable_anywhere, refused_resume, said
from control.text.params import GenerationParams
from control.workers.call import FailureKind, WorkerCallFailed


class Next(enum.Enum):
    RETRY = "retry"
    TIME_LIMIT = "time_limit"
    FAIL = "fail"


_ALWAYS_RETRY = frozenset({FailureKind.LOST, FailureKind.EJECTED, FailureKind.OVERLOADED})


@dataclass(frozen=True, slots=True)
class FailoverPolicy:
    max_engine_retries: int = 1

    def next_step(self, failure: WorkerCallFailed, engine_errors_so_far: int) -> Next:
        kind = failure.kind
        if kind in _ALWAYS_RETRY:
            return Next.RETRY
        if kind is FailureKind.ENGINE:
            return Next.RETRY if engine_errors_so_far < self.max_engine_retries else Next.FAIL
        if kind is FailureKind.DEADLINE:
            return Next.TIME_LIMIT
        return Next.FAIL


DEFAULT_FAILOVER = FailoverPolicy()


# Worker request fields as the client named them in the public request.
_PUBLIC_FIELDS = {
    "max_tokens": "stopping.max_tokens",
    "min_tokens": "stopping.min_tokens",
    "stop_token_ids": "stopping.stop_token_ids",
    "ignore_eos": "stopping.ignore_eos",
    "logprobs": "output.logprobs",
}


def _public_field(field: str, params: GenerationParams) -> str:
    head, sep, rest = field.partition("[")
    if head == "prompt_token_ids":
        return params.prompt_field
    public = _PUBLIC_FIELDS.get(head)
    return f"{public}{sep}{rest}" if public is not None else field


def client_error(failure: WorkerCallFailed, params: GenerationParams) -> StatusError:
    """What the client hears of a worker failure that ends its request before any token."""
    if failure.kind is FailureKind.REJECTED and failure.code == grpc.StatusCode.NOT_FOUND:
        # The worker no longer holds the adapter (unloaded since this process looked).
        return AdapterNotFound(params.model, params.adapter, None)
    if failure.kind is FailureKind.REJECTED:
        violations = [
            FieldViolation(
                _public_field(v.field, params), f"{v.description} (worker {failure.worker})"
            )
            for v in failure.violations
        ] or [FieldViolation("request", f"rejected by worker {failure.worker}: {failure.message}")]
        return InvalidArgument(violations)
    if failure.kind is FailureKind.SLOW_READER:
        return Overloaded(f"the stream was read too slowly: {failure.message}", 1.0)
    return WorkerFailed(failure.worker, failure.message)


def no_worker_left(
    e: NoHealthyWorker,
    params: GenerationParams,
    model: str,
    tokens_so_far: int,
    last_failure: WorkerCallFailed | None,
    interrupted_by: WorkerCallFailed | None,
    refused: WorkerCallFailed | None,
    others_could_serve: bool,
) -> StatusError:
    """What the client hears when no worker is left to try: before any token, what went
    wrong on the last one (every worker full, an engine failure) or just that none is
    healthy; after tokens, that the stream cannot go on, and why. `others_could_serve`:
    some healthy worker not tried is there, which a constrained stream could not move to."""
    if tokens_so_far:
        cause = interrupted_by or last_failure
        if refused is not None:  # the workers that could, would not
            return refused_resume(tokens_so_far, refused, cause)
        if params.constraint is not None and others_could_serve:
            return not_resumable_anywhere(model, params, tokens_so_far, cause)
        return NotResumable(tokens_so_far, said(cause), f"{e}")
    if last_failure is not None and last_failure.kind is FailureKind.OVERLOADED:
        return Overloaded(
            f"model {model!r}: every worker is full ({e})", last_failure.retry_after_s or 1.0
        )
    if last_failure is not None and last_failure.kind is FailureKind.ENGINE:
        return WorkerFailed(last_failure.worker, f"{last_failure.message}; {e}")
    return e
