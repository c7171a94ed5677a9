"""structlog set-up shared by every Switchyard process: console lines for people,
JSON lines for machines (`--log-format json`). Logs go to stderr.

Libraries that log through the standard `logging` module (grpc, vLLM) are routed through
the same processors, so every line of a process has one format.
"""

from __future__ import annotations

import logging
import os
import sys

import structlog

FORMATS = ("console", "json")


def configure_logging(fmt: str | None = None, level: str | None = None) -> None:
    fmt = fmt or os.environ.get("SWITCHYARD_LOG_FORMAT", "console")
    level_name = (level or os.environ.get("SWITCHYARD_LOG_LEVEL", "info")).upper()
    numeric = logging.getLevelNamesMapping().get(level_name, logging.INFO)
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    shared: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    exc: structlog.typing.Processor = (
        structlog.processors.dict_tracebacks if fmt == "json" else structlog.dev.set_exc_info
    )
    structlog.configure(
        processors=[*shared, exc, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    handler.setLevel(numeric)
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(numeric)
    grpc_core = logging.getLogger("grpc._cython.cygrpc")
    if not any(isinstance(f, _LateStatusFilter) for f in grpc_core.filters):
        grpc_core.addFilter(_LateStatusFilter())


class _LateStatusFilter(logging.Filter):
    """grpc logs an error with a traceback whenever a handler ends a call whose client has
    already gone (its deadline passed, or it cancelled): the status has nobody to reach.
    That is a normal end of a stream, not a fault: one debug line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage().startswith("ExecuteBatchError raised in core"):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            record.exc_info = None
            record.exc_text = None
            record.msg, record.args = "a status could not be sent: the client had gone", ()
        return True
