"""Which control-plane files one `Generate` request passes through, in order.

    python -m bench.cpu.request_path [--max-tokens N] [--show]

Starts a control plane in this process with one simulator worker, sends one request to
warm it, then profiles a second one: every function of `control/` entered while that
request's id is bound to the log context (its own task and the tasks it starts). A
function counts once however often a generator resumes. It prints how many files the
request enters, how many times it enters a file it was not in (consecutive calls in one
file count once), and how many of those entries return to a file it had already left;
`--show` prints the walk itself. A reading aid for the code's shape, not a speed figure.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import sys
import tempfile
from pathlib import Path
from types import FrameType
from typing import Any

import grpc
import structlog
from switchyard.v1 import generation_pb2, generation_pb2_grpc

from control.config import load_config
from control.fleet.local_workers import free_port
from control.server import ControlPlane

ROOT = str(Path(__file__).resolve().parents[2] / "control") + "/"
TRACED_ID = "request-path"


async def walk(max_tokens: int) -> list[str]:
    """file:function for each function of control/ the traced request enters."""
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "sim.yaml"
        config.write_text(
            f"listen: 127.0.0.1:{port}\n"
            "models:\n  - {name: sim, engine: sim, model: 'builtin:tiny'}\n"
        )
        plane = ControlPlane(load_config(config))
        await plane.start()
        seen: dict[int, FrameType] = {}  # frames kept alive, so their ids stay unique
        entered: list[str] = []

        def profile(frame: FrameType, event: str, arg: Any) -> None:
            if event != "call" or id(frame) in seen:
                return
            name = frame.f_code.co_filename
            if not name.startswith(ROOT):
                return
            if structlog.contextvars.get_contextvars().get("request_id") != TRACED_ID:
                return
            seen[id(frame)] = frame
            entered.append(f"{name[len(ROOT) :]}:{frame.f_code.co_name}")

        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                for request_id in ("warm-up", TRACED_ID):
                    request = generation_pb2.GenerateRequest(
                        model="sim",
                        text="Hello there",
                        request_id=request_id,
                        stopping=generation_pb2.StoppingParams(
                            max_tokens=max_tokens, ignore_eos=True
                        ),
                    )
                    if request_id == TRACED_ID:
                        sys.setprofile(profile)
                    try:
                        async for _ in stub.Generate(request, timeout=60):
                            pass
                    finally:
                        sys.setprofile(None)
        finally:
            await plane.stop()
        return entered


def summary(entered: list[str]) -> tuple[int, int, int, collections.Counter[str]]:
    """(files, entries, returns to a file already left, entries by file)."""
    entries: list[str] = []
    for step in entered:
        file = step.partition(":")[0]
        if not entries or entries[-1] != file:
            entries.append(file)
    left: set[str] = set()
    returns = 0
    for file in entries:
        returns += file in left
        left.add(file)
    return len(left), len(entries), returns, collections.Counter(entries)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--max-tokens", type=int, default=1)
    p.add_argument("--show", action="store_true", help="print the walk, file by file")
    args = p.parse_args()
    entered = asyncio.run(walk(args.max_tokens))
    files, entries, returns, by_file = summary(entered)
    print(
        f"max_tokens={args.max_tokens}: {files} files, entered {entries} times, "
        f"{returns} returns to a file already left"
    )
    for file, n in by_file.most_common():
        print(f"  {n:3d} {file}")
    if args.show:
        previous = ""
        for step in entered:
            if step != previous:
                print("   ", step)
            previous = step


if __name__ == "__main__":
    main()
