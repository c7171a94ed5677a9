"""The one boundary between request logic and worker transport.

`WorkerClient.generate()` returns a `WorkerCall`: an async context manager whose body
iterates the worker's events (messages with `chunk` set, then one with `final`). The call
owns the worker's in-flight counters and its circuit breaker, and every way a worker
call can fail reaches the caller as one exception type, `WorkerCallFailed`, with a
`FailureKind`. gRPC's errors (`AioRpcError`, `UsageError`, a cancelled call after an
ejection) and `GenerateStream`'s error events are turned into it here and nowhere else,
so failover can be written as a policy over kinds (`control.request.failover`). The
answers of a worker's admin calls (LoadAdapter, UnloadAdapter) become the control plane's
errors here too (`admin_error`).

How a call's messages travel is a `Transport`: the worker's own `Generate` call per
request (`UnaryTransport`) or its shared `GenerateStream` (control.workers.stream); tests
give a worker a fake one.

A client that goes away cancels the task that iterates; that `CancelledError` is never
converted: it propagates, and leaving the `async with` aborts the worker request.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Any, Protocol

import grpc
from switchyard.v1 import common_pb2
from switchyard.worker.v1 import worker_pb2

from control.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Overloaded,
    StatusError,
    WorkerFailed,
)
from control.workers.state import WorkerState
from switchyard_common.rpc_status import FieldViolation, read_details

_ERROR = common_pb2.FINISH_REASON_ERROR


class FailureKind(enum.Enum):
    LOST = "lost"  # the connection broke or closed: the worker may be gone
    EJECTED = "ejected"  # the control plane ejected the worker (hung) mid-call
    ENGINE = "engine"  # the engine failed the request (or ended it without a final)
    REJECTED = "rejected"  # the worker refused the request as invalid: the client's fault
    OVERLOADED = "overloaded"  # the worker is full (RESOURCE_EXHAUSTED)
    DEADLINE = "deadline"  # the request's time ran out
    SLOW_READER = "slow_reader"  # the caller left too many tokens unread for too long


_KIND_BY_CODE: dict[grpc.StatusCode, FailureKind] = {
    grpc.StatusCode.UNAVAILABLE: FailureKind.LOST,
    grpc.StatusCode.CANCELLED: FailureKind.LOST,
    grpc.StatusCode.DEADLINE_EXCEEDED: FailureKind.DEADLINE,
    grpc.StatusCode.INVALID_ARGUMENT: FailureKind.REJECTED,
    grpc.StatusCode.OUT_OF_RANGE: FailureKind.REJECTED,
    grpc.StatusCode.FAILED_PRECONDITION: FailureKind.REJECTED,
    grpc.StatusCode.NOT_FOUND: FailureKind.REJECTED,  # an adapter it no longer holds
    grpc.StatusCode.RESOURCE_EXHAUSTED: FailureKind.OVERLOADED,
}


class WorkerCallFailed(Exception):
    """A worker call ended without a usable final. `worker` is the worker's address;
    `violations` are the fields the worker blamed (REJECTED); `retry_after_s` its hint
    (OVERLOADED)."""

    def __init__(
        self,
        kind: FailureKind,
        worker: str,
        message: str,
        *,
        code: grpc.StatusCode | None = None,
        violations: tuple[FieldViolation, ...] = (),
        retry_after_s: float | None = None,
        counted: bool = False,
    ) -> None:
        super().__init__(f"worker {worker}: {kind.value}: {message}")
        self.counted = counted  # already recorded on the worker's circuit breaker
        self.kind = kind
        self.worker = worker
        self.message = message
        self.code = code
        self.violations = violations
        self.retry_after_s = retry_after_s

    @classmethod
    def from_status(
        cls,
        worker: str,
        code: grpc.StatusCode,
        message: str,
        violations: tuple[FieldViolation, ...] = (),
        retry_after_s: float | None = None,
    ) -> WorkerCallFailed:
        kind = _KIND_BY_CODE.get(code, FailureKind.ENGINE)
        return cls(
            kind,
            worker,
            f"{code.name}: {message}",
            code=code,
            violations=violations,
            retry_after_s=retry_after_s,
        )


class EventSource(Protocol):
    """What the transport hands the call: a `Generate` call or a `GenerateStream`
    attempt. Both iterate messages with `chunk` or `final` set."""

    def __aiter__(self) -> AsyncIterator[Any]: ...

    def cancel(self) -> bool: ...

    def done(self) -> bool: ...


class Transport(Protocol):
    """How a worker's generations travel."""

    def open(self, request: worker_pb2.GenerateRequest, timeout: float | None) -> EventSource:
        """Start `request`; raises what its transport raises (converted by the call)."""
        ...

    async def close(self) -> None: ...


class UnaryTransport:
    """A `Generate` call per request."""

    def __init__(self, stub: Any) -> None:
        self._stub = stub
        self._attempts = itertools.count(1)

    def open(self, request: worker_pb2.GenerateRequest, timeout: float | None) -> EventSource:
        # Generate keys requests by request_id on the worker: make each attempt's unique.
        request.request_id = f"{request.request_id}~{next(self._attempts)}"
        call: EventSource = self._stub.Generate(request, timeout=timeout)
        return call

    async def close(self) -> None:
        pass  # its calls end with the channel


class WorkerCall:
    """One generation on one worker. Use as `async with worker.generate(...) as events`."""

    def __init__(
        self,
        worker: WorkerState,
        transport: Transport,
        request: worker_pb2.GenerateRequest,
        timeout: float | None,
        cost_tokens: int,
        prompt_tokens: int = 0,
    ) -> None:
        self._worker = worker
        self._transport = transport
        self._request = request
        self._timeout = timeout
        self._cost = cost_tokens
        self._prefill = prompt_tokens  # counted on the worker until the first message
        self.adapter = request.adapter  # the LoRA adapter it uses ("" for none)
        self._source: EventSource | None = None
        self._ejected = False
        self._finished = False

    @property
    def worker(self) -> WorkerState:
        return self._worker

    @property
    def source(self) -> EventSource | None:
        """Where its events come from, once open (a `StreamCall` on a GenerateStream)."""
        return self._source

    async def __aenter__(self) -> AsyncIterator[Any]:
        self._worker.begin_call(self, self._cost, self._prefill)
        try:
            self._source = self._transport.open(self._request, self._timeout)
        except BaseException as exc:
            self._release()
            raise self._convert(exc) from exc
        return self._events()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._release()
        source = self._source
        if source is not None and not source.done():
            source.cancel()  # the worker aborts the engine request

    def cancel(self) -> None:
        """Stop now (a stop string matched): the worker aborts the engine request."""
        if self._source is not None and not self._source.done():
            self._source.cancel()

    def eject(self) -> None:
        """The worker was ejected: the call fails with EJECTED and its request can move."""
        self._ejected = True
        if self._source is not None and not self._source.done():
            self._source.cancel()

    def _release(self) -> None:
        self._worker.end_call(self, self._cost, self._prefill)
        self._prefill = 0

    def _prefilled(self) -> None:
        if self._prefill:
            self._worker.prefilled(self._prefill)
            self._prefill = 0

    async def _events(self) -> AsyncIterator[Any]:
        assert self._source is not None
        address = self._worker.address
        try:
            async for message in self._source:
                self._prefilled()
                if message.HasField("final"):
                    final = message.final
                    if final.finish_reason == _ERROR:
                        raise WorkerCallFailed(
                            FailureKind.ENGINE, address, final.error_message or "engine error"
                        )
                    self._finished = True
                    self._worker.breaker.record_success()
                    yield message
                    return
                yield message
        except WorkerCallFailed as failure:  # a GenerateStream error event or break
            if failure.kind is FailureKind.LOST and not failure.counted:
                self._worker.breaker.record_failure()
            raise
        except asyncio.CancelledError as exc:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the caller went away
            # Cancelled from our side, not the caller's: an ejection, or the channel
            # closing under the call (unload, shutdown, a worker leaving).
            if self._ejected:
                raise WorkerCallFailed(
                    FailureKind.EJECTED, address, "the worker was ejected (canary failing)"
                ) from exc
            raise WorkerCallFailed(
                FailureKind.LOST, address, "the call was cancelled: the channel closed"
            ) from exc
        except Exception as exc:
            raise self._convert(exc) from exc
        if not self._finished:
            raise WorkerCallFailed(
                FailureKind.ENGINE, address, "the worker ended the request without a final"
            )

    def _convert(self, exc: BaseException) -> BaseException:
        address = self._worker.address
        if isinstance(exc, WorkerCallFailed | asyncio.CancelledError):
            return exc
        if isinstance(exc, grpc.aio.AioRpcError):
            details = read_details(exc.trailing_metadata())
            failure = WorkerCallFailed.from_status(
                address,
                exc.code(),
                exc.details() or "",
                details.violations,
                details.retry_after_s,
            )
        elif isinstance(exc, grpc.aio.UsageError):  # the channel closed under us (unload)
            failure = WorkerCallFailed(FailureKind.LOST, address, f"channel closed: {exc}")
        else:
            return exc  # a bug of ours: not a worker failure, let it surface
        if failure.kind is FailureKind.LOST:
            self._worker.breaker.record_failure()
        return failure


def admin_error(address: str, e: grpc.aio.AioRpcError) -> StatusError:
    """A worker's answer to an adapter call, as the control plane's error: the caller
    hears the worker's code, its field violations and its words, with its address."""
    code = e.code()
    message = f"worker {address}: {e.details() or code.name}"
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        said = read_details(e.trailing_metadata()).violations
        return InvalidArgument(list(said) or [FieldViolation("path", message)])
    if code == grpc.StatusCode.NOT_FOUND:
        return NotFound(message)
    if code == grpc.StatusCode.ALREADY_EXISTS:
        return AlreadyExists(message)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return Overloaded(message, retry_after_s=0.0)
    if code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED):
        return FailedPrecondition(f"{message} (this worker has no LoRA)", field="adapter")
    return WorkerFailed(address, e.details() or code.name)
