"""`switchyard`: run the service, or talk to one.

switchyard serve [--config FILE]          # no config: the generated tiny model on vLLM
switchyard generate --model tiny "Hello"  # stream a generation to the terminal
switchyard complete | tokenize | models | workers | load | unload | drain
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
from pathlib import Path

from control.config import (
    DEFAULT_LISTEN,
    ConfigError,
    ServeConfig,
    default_config,
    load_config,
)
from switchyard.client.cli import add_commands, run
from switchyard_common.logs import configure_logging


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="switchyard", description=__doc__.split("\n")[0])
    p.add_argument("--log-format", choices=("console", "json"), default=None)
    p.add_argument("--log-level", default=None)
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the control plane and its workers")
    s.add_argument("--config", type=Path, help="YAML config; default: the embedded tiny model")
    s.add_argument("--listen", help=f"host:port to listen on (default {DEFAULT_LISTEN})")
    s.add_argument(
        "--metrics-listen",
        metavar="HOST:PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics (config: metrics.listen)",
    )
    s.add_argument(
        "--routers",
        type=_positive,
        default=1,
        help="control-plane processes serving the port (SO_REUSEPORT); default 1",
    )
    s.add_argument(
        "--listeners",
        type=_positive,
        default=None,
        help="gRPC servers each process runs on the port, each accepting new calls on its "
        "own (grpc.aio accepts one at a time per server); default 16",
    )
    # Internal: how the supervisor starts its extra router processes.
    s.add_argument("--router-of", help=argparse.SUPPRESS)
    s.add_argument("--ready-file", type=Path, help=argparse.SUPPRESS)

    add_commands(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    configure_logging(args.log_format, args.log_level)
    if args.command == "serve":
        return _serve(args)
    try:
        return run(args)
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly, as cat does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _serve(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config) if args.config else default_config()
    except ConfigError as e:
        print(f"switchyard: {e}", file=sys.stderr)
        return 2
    if args.listen:
        config = dataclasses.replace(config, listen=args.listen)
    if args.metrics_listen:
        config = dataclasses.replace(config, metrics_listen=args.metrics_listen)
    try:
        return _run_serve(config, args)
    except ConfigError as e:  # a file the config names (the tokens file) is bad
        print(f"switchyard: {e}", file=sys.stderr)
        return 2


def _run_serve(config: ServeConfig, args: argparse.Namespace) -> int:
    from control.server import DEFAULT_LISTENERS, serve

    # asyncio's own loop, not uvloop: this process forks workers and routers, and a
    # child forked by uvloop (fork(), so gRPC's fork handlers run) once died of SIGSEGV
    # before exec.
    return asyncio.run(
        serve(
            config,
            routers=args.routers,
            router_of=args.router_of,
            ready_file=args.ready_file,
            listeners=args.listeners or DEFAULT_LISTENERS,
        )
    )


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


if __name__ == "__main__":
    sys.exit(main())
