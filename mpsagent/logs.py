"""structlog set-up: one event per line, JSON or console; the standard library's loggers (grpclib's) go through
the same renderer. Exceptions are rendered without local variables."""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

from mpsagent.settings import LogFormat


def configure_logging(log_format: LogFormat = LogFormat.AUTO, level: str = "info") -> None:
    use_json = log_format is LogFormat.JSON or (log_format is LogFormat.AUTO and not sys.stderr.isatty())
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: Any
    if use_json:
        renderer = structlog.processors.JSONRenderer()
        shared.append(
            structlog.processors.ExceptionRenderer(structlog.tracebacks.ExceptionDictTransformer(show_locals=False))
        )
    else:
        renderer = structlog.dev.ConsoleRenderer(
            colors=sys.stderr.isatty(), exception_formatter=structlog.dev.plain_traceback
        )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # grpclib logs every cancelled stream at INFO; the agent reports what matters itself.
    logging.getLogger("grpclib").setLevel(max(logging.WARNING, root.level))
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    return structlog.stdlib.get_logger(name)
