"""Structured logging: one line per request, JSON for machines or console for people."""

from __future__ import annotations

import logging
import sys

import orjson
import structlog


def _dumps(obj, **_kw) -> str:
    return orjson.dumps(obj, default=str).decode()


def configure_logging(fmt: str = "console", level: str = "info") -> None:
    lvl = getattr(logging, level.upper(), logging.INFO)
    renderer = (structlog.processors.JSONRenderer(serializer=_dumps) if fmt == "json"
                else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty()))
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
