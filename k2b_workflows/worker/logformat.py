"""What a worker prints when the project configured no logging for it.

Without a ``LOGGING`` setting that reaches the ``k2b_workflows`` logger, a
worker wrote nothing at all: not its start line, not its stop line, not a lost
database or a lease that expired. An operator could not tell a worker that
runs from one that hangs. ``manage.py runworkflows`` therefore attaches one
stderr handler for its lifetime when no handler would receive the kernel's
records, as ``runserver`` prints its requests without any configuration:

- the worker's own lines (``k2b_workflows``, ``k2b_workflows.fleet``) from INFO:
  start, stop with its statistics, retries, database weather;
- the per-step events (``k2b_workflows.events``) from WARNING only: effects in
  doubt and incidents, not one line per step.

A project whose ``LOGGING`` routes ``k2b_workflows`` anywhere keeps exactly
what it configured. ``--log-format json`` prints one JSON object per line with
the run's fields (``JsonFormatter``, usable in ``LOGGING`` too).
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any, TextIO

#: The fields ``kernel/events.py`` and the worker attach to their records.
FIELDS = (
    "event",
    "run_id",
    "workflow",
    "step",
    "generation",
    "effect_key",
    "action",
    "effect",
    "error_code",
    "answer",
    "worker_id",
)

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
FORMATS = ("text", "json")


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message and the run's fields."""

    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, Any] = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        data.update({key: getattr(record, key) for key in FIELDS if hasattr(record, key)})
        if record.exc_info:
            data["exception"] = self.formatException(record.exc_info)
        return json.dumps(data, default=str)


def configured() -> bool:
    """Whether the project's logging already takes the kernel's records somewhere."""
    return logging.getLogger("k2b_workflows").hasHandlers()


class WorkerHandler(logging.StreamHandler):
    """The stderr handler of a worker without logging configuration, and what it changed.

    The per-step events logger is raised to WARNING rather than filtered: its
    records are built only when its level is on, and every step passes there.
    """

    def __init__(self, log_format: str, stream: TextIO | None = None) -> None:
        super().__init__(stream or sys.stderr)
        self.setFormatter(
            JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT)
        )
        self.levels: dict[str, int] = {}

    def install(self) -> None:
        for name, level in (
            ("k2b_workflows", logging.INFO),
            ("k2b_workflows.events", logging.WARNING),
        ):
            logger = logging.getLogger(name)
            self.levels[name] = logger.level
            if logger.level == logging.NOTSET or logger.level > level:
                logger.setLevel(level)
        logging.getLogger("k2b_workflows").addHandler(self)

    def uninstall(self) -> None:
        logging.getLogger("k2b_workflows").removeHandler(self)
        for name, level in self.levels.items():
            logging.getLogger(name).setLevel(level)


def attach(log_format: str = "text", stream: TextIO | None = None) -> WorkerHandler | None:
    """Attach the worker's stderr handler unless logging is configured; returns it (or None).

    The caller removes it with ``detach`` when the worker stops.
    """
    if log_format not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, not {log_format!r}")
    if configured():
        return None
    handler = WorkerHandler(log_format, stream)
    handler.install()
    return handler


def detach(handler: WorkerHandler | None) -> None:
    if handler is not None:
        handler.uninstall()
