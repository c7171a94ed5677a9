"""`switchyard-pyworker` / `python -m pyworker`: serve one vLLM engine over gRPC.

The engine is built first and the gRPC server started after it: vLLM starts its engine
core in a child process, and gRPC must not exist yet when it does. vLLM spawns that
child, which re-imports this module, so nothing may run outside `main()`.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import sys
import time
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

import structlog

from pyworker.stderr_tail import StderrTail
from switchyard_common.logs import configure_logging
from switchyard_common.ports import Reservation
from switchyard_common.tls import server_credentials
from switchyard_common.wire import DEFAULT_REQUEST_IDLE_S

log = structlog.get_logger(__name__)
T = TypeVar("T")

EXIT_OK = 0
EXIT_ENGINE_DEAD = 1
EXIT_STARTUP_FAILED = 2


def engine_args_json(text: str) -> dict[str, Any]:
    """`--engine-args`: a JSON object of vLLM engine arguments, types kept."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object of engine arguments")
    return value


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    from pyworker.server import DEFAULT_GRACE_S

    parser = argparse.ArgumentParser(
        prog="switchyard-pyworker",
        description="Serve one model with vLLM behind the switchyard.worker.v1.Worker API.",
    )
    parser.add_argument("--model", required=True, help="model directory or name")
    parser.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, required=True, help="listen port (0: any free port)")
    parser.add_argument(
        "--engine-args",
        type=engine_args_json,
        default={},
        help="vLLM engine arguments as a JSON object, named as vLLM's AsyncEngineArgs names "
        'them, e.g. \'{"max_model_len": 2048, "enforce_eager": true}\'',
    )
    parser.add_argument(
        "--termination-log",
        type=Path,
        default=None,
        help="where to write the reason when the worker cannot start (one line)",
    )
    parser.add_argument(
        "--grace", type=float, default=DEFAULT_GRACE_S, help="shutdown grace in seconds"
    )
    parser.add_argument(
        "--request-idle-s",
        type=float,
        default=DEFAULT_REQUEST_IDLE_S,
        help="how long a call may wait for its request message (DEADLINE_EXCEEDED after)",
    )
    parser.add_argument("--tls-cert", help="serve TLS with this certificate (PEM)")
    parser.add_argument("--tls-key", help="... and this key (PEM)")
    parser.add_argument(
        "--tls-client-ca", help="mutual TLS: only clients with a certificate this CA signed"
    )
    parser.add_argument("--log-format", choices=("console", "json"), default="console")
    parser.add_argument(
        "--log-level", choices=("debug", "info", "warning", "error"), default="info"
    )
    return parser.parse_args(argv)


def startup_failed(args: argparse.Namespace, reason: str) -> int:
    """Log why the worker cannot start, write it where its supervisor reads it, exit 2."""
    log.error("startup failed", reason=reason)
    if args.termination_log is not None:
        try:
            args.termination_log.write_text(reason + "\n")
        except OSError as exc:
            log.warning("cannot write the termination log", error=str(exc))
    return EXIT_STARTUP_FAILED


async def run(args: argparse.Namespace, tail: StderrTail | None = None) -> int:
    from pyworker.engine import build_engine
    from pyworker.engine_args import EngineArgsError
    from pyworker.server import StopReason, serve

    def detach() -> None:
        """This process's stderr back to the real one, before it says anything more: a
        line left in the tail's pipe can be lost when the process exits."""
        if tail is not None:
            tail.detach()

    credentials = None
    try:
        # Fail before minutes of engine start, not after, and keep the port meanwhile.
        if args.tls_cert or args.tls_key or args.tls_client_ca:
            if not (args.tls_cert and args.tls_key):
                detach()
                return startup_failed(args, "--tls-cert and --tls-key go together")
            credentials = server_credentials(
                args.tls_cert, args.tls_key, args.tls_client_ca, what="--tls"
            )
        reservation = Reservation(args.host, args.port)
    except OSError as exc:
        detach()
        return startup_failed(args, str(exc))
    started = time.monotonic()
    try:
        engine = build_engine(args.model, args.engine_args, tail)
    except EngineArgsError as exc:
        detach()
        reservation.release()
        return startup_failed(args, str(exc))
    except Exception as exc:
        detach()
        log.exception("engine failed to load", model=args.model)
        reservation.release()
        return startup_failed(args, f"engine failed to load: {type(exc).__name__}: {exc}")
    detach()
    log.info("startup", seconds=round(time.monotonic() - started, 1))
    code = EXIT_STARTUP_FAILED
    try:
        reason = await serve(
            engine,
            args.host,
            args.port,
            grace_s=args.grace,
            reservation=reservation,
            credentials=credentials,
            request_idle_s=args.request_idle_s,
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

    prepare_environment(args.engine_args)
    tail = StderrTail()  # before vLLM starts its engine core, which inherits it
    return run_event_loop(run(args, tail))


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
