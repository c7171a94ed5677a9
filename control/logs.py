"""structlog set-up shared by every Switchyard process: console lines for people,
JSON lines for machines (`--log-format json`). Logs go to stderr."""

from __future__ import annotations

import logging
import os
import sys

import structlog


def configure_logging(fmt: str | None = None, level: str | None = None) -> None:
    fmt = fmt or os.environ.get("SWITCHYARD_LOG_FORMAT", "console")
    level_name = (level or os.environ.get("SWITCHYARD_LOG_LEVEL", "info")).upper()
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping().get(level_name, logging.INFO)
        ),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
