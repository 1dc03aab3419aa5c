"""structlog set-up: JSON lines on unbuffered stdout for journald, a console renderer on a
terminal. Context (resize id, phase, worker) is bound through contextvars by the reactor."""

from __future__ import annotations

import logging
import sys

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def configure_logging(fmt: str = "auto", level: str = "info", stream=None) -> None:  # type: ignore[no-untyped-def]
    stream = stream or sys.stdout
    console = fmt == "console" or (fmt == "auto" and stream.isatty())
    renderer = structlog.dev.ConsoleRenderer() if console else structlog.processors.JSONRenderer()
    processors = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.dict_tracebacks if not console else structlog.dev.set_exc_info,
        renderer,
    ]
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
