"""`switchyard-pyworker` / `python -m pyworker`: serve one vLLM engine over gRPC.

The engine is built first and the gRPC server started after it: vLLM starts its engine
core in a child process, and gRPC must not exist yet when it does. vLLM spawns that
child, which re-imports this module, so nothing may run outside `main()`.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import sys
import time
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

import structlog

from switchyard_common.logs import configure_logging
from switchyard_common.ports import Reservation

log = structlog.get_logger(__name__)
T = TypeVar("T")

EXIT_OK = 0
EXIT_ENGINE_DEAD = 1
EXIT_STARTUP_FAILED = 2

def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    from pyworker.engine import DEFAULT_MAX_NUM_BATCHED_TOKENS
    from pyworker.server import DEFAULT_GRACE_S

    parser = argparse.ArgumentParser(
        prog="switchyard-pyworker",
        description="Serve one model with vLLM behind the switchyard.worker.v1.Worker API.",
    )
    parser.add_argument("--model", required=True, help="model directory or name")
    parser.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, required=True, help="listen port (0: any free port)")
    parser.add_argument("--max-model-len", type=int, default=None, help="context length")
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
        help="tokens per engine step; keep it above the longest prompt on CPU "
        f"(default {DEFAULT_MAX_NUM_BATCHED_TOKENS})",
    )
    parser.add_argument("--dtype", default="auto", help="weights dtype (default auto)")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="max concurrent sequences")
    parser.add_argument("--seed", type=int, default=None, help="engine seed")
    parser.add_argument(
        "--enforce-eager", action="store_true", help="disable graph capture / compilation"
    )
    parser.add_argument(
        "--grace", type=float, default=DEFAULT_GRACE_S, help="shutdown grace in seconds"
    )
    parser.add_argument("--log-format", choices=("console", "json"), default="console")
    parser.add_argument(
        "--log-level", choices=("debug", "info", "warning", "error"), default="info"
    )
    return parser.parse_args(argv)


async def run(args: argparse.Namespace) -> int:
    from pyworker.engine import EngineSettings, build_engine
    from pyworker.server import StopReason, serve

    settings = EngineSettings(
        model=args.model,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        seed=args.seed,
        enforce_eager=args.enforce_eager,
    )
    try:
        # Fail before minutes of engine start, not after, and keep the port meanwhile.
        reservation = Reservation(args.host, args.port)
    except OSError as exc:
        log.error("startup failed", error=str(exc))
        return EXIT_STARTUP_FAILED
    started = time.monotonic()
    try:
        engine = build_engine(settings)
    except Exception:
        log.exception("engine failed to load", model=args.model)
        return EXIT_STARTUP_FAILED
    log.info("startup", seconds=round(time.monotonic() - started, 1))
    code = EXIT_STARTUP_FAILED
    try:
        reason = await serve(
            engine, args.host, args.port, grace_s=args.grace, reservation=reservation
        )
        code = EXIT_ENGINE_DEAD if reason is StopReason.ENGINE_DEAD else EXIT_OK
        log.info("stopped", reason=reason.value)
    except Exception:
        log.exception("server failed")
    finally:
        log.info("shutting down engine")
        engine.shutdown()
        del engine
        gc.collect()  # let AsyncLLM go while its modules are still importable
    log.info("exiting", code=code)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(args.log_format, args.log_level)
    from pyworker.engine import prepare_environment

    prepare_environment()
    return run_event_loop(run(args))


def run_event_loop(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` on uvloop when it is installed (as vLLM's own servers do: its callbacks
    and futures cost less per message, which shows in time to first token), else on
    asyncio's loop. SWITCHYARD_EVENT_LOOP=asyncio forces the latter. The worker forks
    nothing once gRPC runs (its engine process is started before), so uvloop is safe here."""
    if os.environ.get("SWITCHYARD_EVENT_LOOP", "uvloop") != "asyncio":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                return runner.run(coro)
    return asyncio.run(coro)


if __name__ == "__main__":
    sys.exit(main())
