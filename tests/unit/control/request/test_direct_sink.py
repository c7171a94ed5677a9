from __future__ import annotations

from typing import Any

from control.api.front import FrontCall
from control.request.direct import as_chunk_sink


class AioLikeContext:
    """What a grpc.aio context offers a handler: writes that are awaited, no `write_now`."""

    async def write(self, message: Any) -> None:
        pass

    def cancelled(self) -> bool:
        return False


def test_the_native_fronts_calls_take_chunks_where_they_arrive() -> None:
    call = FrontCall.__new__(FrontCall)  # its class is what counts, not its state
    assert as_chunk_sink(call) is call


def test_a_grpc_aio_context_is_no_chunk_sink() -> None:
    assert as_chunk_sink(AioLikeContext()) is None
    assert as_chunk_sink(None) is None
