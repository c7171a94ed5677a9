"""`switchyard.client`: a typed client of Switchyard's public API, blocking (`Client`)
and asyncio (`AsyncClient`).

Chunks and finals come as typed values (`Chunk`, `Final`); failures as typed exceptions
(`InvalidArgument` with its `violations`, `ResourceExhausted` with `retry_after_s`, ...).
Deadlines and metadata (a bearer token, a W3C `traceparent`) go with every call. A call
that fails with RESOURCE_EXHAUSTED or UNAVAILABLE before its first token is retried
after the server's RetryInfo delay, or a jittered backoff (`RetryPolicy`). Stopping
iterating a stream cancels its call.
"""

from switchyard.client._common import NO_RETRY, RetryPolicy, Tls, generate_request
from switchyard.client.aio import AsyncClient, AsyncStream
from switchyard.client.errors import (
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    FieldViolation,
    Internal,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    SwitchyardError,
    Unauthenticated,
    Unavailable,
    from_rpc_error,
)
from switchyard.client.sync import Client, Stream
from switchyard.client.types import (
    Chunk,
    Completion,
    Final,
    ModelInfo,
    Timing,
    TokenLogprob,
    Tokens,
    Usage,
)

__all__ = [
    "NO_RETRY",
    "AsyncClient",
    "AsyncStream",
    "Cancelled",
    "Chunk",
    "Client",
    "Completion",
    "DeadlineExceeded",
    "FailedPrecondition",
    "FieldViolation",
    "Final",
    "Internal",
    "InvalidArgument",
    "ModelInfo",
    "NotFound",
    "PermissionDenied",
    "ResourceExhausted",
    "RetryPolicy",
    "Stream",
    "SwitchyardError",
    "Timing",
    "Tls",
    "TokenLogprob",
    "Tokens",
    "Unauthenticated",
    "Unavailable",
    "Usage",
    "from_rpc_error",
    "generate_request",
]
