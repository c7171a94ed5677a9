"""What parsing request bodies in the call (switchyard_common.wire) costs, side by side
with grpc's own parsing, in one run: two grpc.aio servers in this process serve the same
trivial Generation servicer, one registered plainly and one through `Wire`, and one
client times unary calls and streamed messages against each, alternating rounds.

    python -m bench.cpu.wire_overhead                     # 3 rounds of 2000 calls, 20000 messages
    python -m bench.cpu.wire_overhead --calls 5000 --messages 50000 --rounds 5

It prints microseconds per call and per streamed message for each, and their ratio. This
is a benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from switchyard.v1 import generation_pb2, generation_pb2_grpc

from switchyard_common.wire import Wire


class Echo(generation_pb2_grpc.GenerationServicer):  # type: ignore[misc]
    """ListModels answers at once; Generate streams `stopping.max_tokens` chunks."""

    async def ListModels(self, request: Any, context: Any) -> Any:
        return generation_pb2.ListModelsResponse()

    async def Generate(self, request: Any, context: Any) -> AsyncIterator[Any]:
        chunk = generation_pb2.GenerateResponse(chunk=generation_pb2.Chunk(token_ids=[7], text="x"))
        for _ in range(request.stopping.max_tokens):
            yield chunk


async def serve(wired: bool) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    if wired:
        Wire().add(server, generation_pb2_grpc.add_GenerationServicer_to_server, Echo())
    else:
        generation_pb2_grpc.add_GenerationServicer_to_server(Echo(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


async def measure(port: int, calls: int, messages: int) -> tuple[float, float]:
    """(µs per unary call, µs per streamed message), one call at a time."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        await stub.ListModels(generation_pb2.ListModelsRequest())
        began = time.perf_counter()
        for _ in range(calls):
            await stub.ListModels(generation_pb2.ListModelsRequest())
        per_call = (time.perf_counter() - began) / calls * 1e6
        request = generation_pb2.GenerateRequest(
            model="m", stopping=generation_pb2.StoppingParams(max_tokens=messages)
        )
        began = time.perf_counter()
        got = 0
        async for _ in stub.Generate(request):
            got += 1
        per_message = (time.perf_counter() - began) / max(got, 1) * 1e6
    return per_call, per_message


async def main(calls: int, messages: int, rounds: int) -> None:
    plain, plain_port = await serve(wired=False)
    wired, wired_port = await serve(wired=True)
    results: dict[str, list[tuple[float, float]]] = {"grpc parses": [], "wire parses": []}
    try:
        for _ in range(rounds):
            results["grpc parses"].append(await measure(plain_port, calls, messages))
            results["wire parses"].append(await measure(wired_port, calls, messages))
    finally:
        await plain.stop(0)
        await wired.stop(0)
    best = {k: (min(c for c, _ in v), min(m for _, m in v)) for k, v in results.items()}
    print(f"{'':12} {'us/call':>9} {'us/message':>11}  (best of {rounds} rounds)")
    for name, (c, m) in best.items():
        print(f"{name:12} {c:9.1f} {m:11.2f}")
    (pc, pm), (wc, wm) = best["grpc parses"], best["wire parses"]
    print(f"{'ratio':12} {wc / pc:9.3f} {wm / pm:11.3f}")


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--messages", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    asyncio.run(main(args.calls, args.messages, args.rounds))


if __name__ == "__main__":
    cli()
