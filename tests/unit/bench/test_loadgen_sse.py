"""The load generator's SSE reader (bench/load/loadgen.py), on bytes (the load generator against
a real worker: tests/integration/bench/test_loadgen.py)."""

from __future__ import annotations


async def test_sse_lines_split_on_newline_only() -> None:
    from bench.load.loadgen import _sse_data

    class Resp:
        async def aiter_bytes(self):  # type: ignore[no-untyped-def]
            payload = 'data: {"text": "a\u2028b\x1cc"}\n\ndata: {"n"'.encode()
            yield payload
            yield b": 1}\r\n\ndata: [DONE]\n\n"

    got = [x async for x in _sse_data(Resp())]
    assert got == ['{"text": "a\u2028b\x1cc"}', '{"n": 1}']
