"""Where the control plane's errors become gRPC statuses, with rich details
(`google.rpc.Status` in the `grpc-status-details-bin` trailer).

The table itself is the error classes (`control.errors` and the shared kinds of
`switchyard_common.status_error`): each names its status code and carries its details;
this module reads them, and nothing else in the control plane builds an error status.
"""

from __future__ import annotations

from typing import Any, NoReturn

import grpc

from switchyard_common.rpc_status import Trailers
from switchyard_common.status_error import StatusError


def status_code(err: StatusError) -> grpc.StatusCode:
    return err.code


def to_rpc_status(err: StatusError) -> tuple[grpc.StatusCode, str, Trailers]:
    """(code, message, trailing metadata with the rich google.rpc.Status)."""
    return err.code, err.message, err.trailers()


async def abort_rpc(context: Any, err: StatusError) -> NoReturn:
    """End the RPC with `err`'s status, rich details included."""
    code, message, trailers = to_rpc_status(err)
    await context.abort(code, message, trailing_metadata=trailers)
    raise AssertionError("unreachable")  # context.abort raises
