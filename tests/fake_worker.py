"""A worker transport that answers from a script, without a network: request and
failover tests run the real pipeline on it in milliseconds.

`FakeTransport(script)` is a `control.workers.call.Transport`. `script(request)` is an
async iterator of the worker's messages for that request (chunks, then a Final); raising
`grpc.aio.AioRpcError` from it is the worker failing the call (`rpc_error`). The
transport keeps every request it was sent and counts the calls cancelled.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import grpc
from switchyard.v1 import common_pb2
from switchyard.worker.v1 import worker_pb2

from switchyard_common.rpc_status import FieldViolation, status_trailers

Script = Callable[[worker_pb2.GenerateRequest], AsyncIterator[worker_pb2.GenerateResponse]]


def rpc_error(
    code: grpc.StatusCode,
    message: str = "",
    violations: Sequence[FieldViolation] = (),
    retry_after_s: float | None = None,
) -> grpc.aio.AioRpcError:
    trailers = status_trailers(code, message, violations=violations, retry_after_s=retry_after_s)
    return grpc.aio.AioRpcError(
        code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailers), details=message
    )


def chunk(*ids: int) -> worker_pb2.GenerateResponse:
    return worker_pb2.GenerateResponse(chunk=worker_pb2.Chunk(token_ids=ids))


def final(reason: int = common_pb2.FINISH_REASON_LENGTH) -> worker_pb2.GenerateResponse:
    return worker_pb2.GenerateResponse(final=worker_pb2.Final(finish_reason=reason))


def tokens(ids: Sequence[int], then: BaseException | None = None) -> Script:
    """A worker that sends `ids` one per chunk, then fails with `then` or finishes
    (LENGTH once max_tokens are out)."""

    async def script(request: worker_pb2.GenerateRequest) -> AsyncIterator[Any]:
        for i in ids[: request.max_tokens]:
            yield chunk(i)
        if then is not None:
            raise then
        yield final()

    return script


def fails(error: BaseException) -> Script:
    """A worker that fails every call before any token."""
    return tokens([], then=error)


class _Source:
    def __init__(self, messages: AsyncIterator[Any], transport: FakeTransport) -> None:
        self._messages = messages
        self._transport = transport
        self._done = False

    async def __aiter__(self) -> AsyncIterator[Any]:
        try:
            async for message in self._messages:
                yield message
        finally:
            self._done = True

    def cancel(self) -> bool:
        if self._done:
            return False
        self._done = True
        self._transport.cancelled += 1
        return True

    def done(self) -> bool:
        return self._done


class FakeTransport:
    def __init__(self, script: Script) -> None:
        self.script = script
        self.requests: list[worker_pb2.GenerateRequest] = []
        self.cancelled = 0

    def open(self, request: worker_pb2.GenerateRequest, timeout: float | None) -> _Source:
        sent = worker_pb2.GenerateRequest()
        sent.CopyFrom(request)
        self.requests.append(sent)
        return _Source(self.script(sent), self)

    async def close(self) -> None:
        pass
