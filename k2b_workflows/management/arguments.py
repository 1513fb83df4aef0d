"""Argument types and output escaping shared by the management commands.

Each type raises ``argparse.ArgumentTypeError`` with a one-line message:
on the command line argparse prints it under the usage line and exits 2,
and ``call_command`` raises it as a ``CommandError`` ("Error: argument
--batch: ..."). No traceback for ``nan``, ``inf``, ``1e12`` days or a batch
past PostgreSQL's ``bigint``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
from collections.abc import Callable
from typing import Any

from django.core.management.base import CommandError


def integer(minimum: int, maximum: int) -> Callable[[str], int]:
    """An ``int`` in ``[minimum, maximum]``, for ``type=`` of an argument."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number, not {text!r:.40}") from None
        if not minimum <= value <= maximum:
            raise argparse.ArgumentTypeError(
                f"must be between {minimum} and {maximum}, not {text:.40}"
            )
        return value

    return parse


def number(minimum: float, maximum: float) -> Callable[[str], float]:
    """A finite ``float`` in ``(minimum, maximum]``: ``nan`` and ``inf`` are refused."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, not {text!r:.40}") from None
        if not math.isfinite(value) or not minimum < value <= maximum:
            raise argparse.ArgumentTypeError(
                f"must be a number above {minimum:g} and at most {maximum:g}, not {text:.40}"
            )
        return value

    return parse


def json_value(text: str, option: str) -> Any:
    """Parse a JSON argument; a malformed or absurdly nested one is a ``CommandError``."""
    try:
        return json.loads(text)
    except ValueError as exc:
        raise CommandError(f"{option} is not valid JSON: {exc}") from None
    except RecursionError:
        raise CommandError(f"{option} is nested too deeply") from None


def printable(value: Any) -> str:
    """``value`` as text safe for a terminal: control characters shown escaped.

    Wait keys, workflow names and error messages come from users and
    providers; printed raw, an escape sequence in one rewrites the operator's
    terminal (hides lines, changes the title, fakes output).
    """
    text = str(value)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def text(max_length: int) -> Callable[[str], str]:
    """A non-empty string that fits its column, without NUL (PostgreSQL refuses it)."""

    def parse(value: str) -> str:
        if not value or "\x00" in value or len(value) > max_length:
            raise argparse.ArgumentTypeError(
                f"must be 1 to {max_length} characters without NUL, not {printable(value)[:40]!r}"
            )
        return value

    return parse


def aware_datetime(text: str) -> dt.datetime:
    """An ISO 8601 date and time; a naive one is left to the API, which says why it refuses."""
    try:
        return dt.datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be an ISO 8601 date and time with its UTC offset (2026-12-24T09:00:00+01:00),"
            f" not {printable(text)[:40]!r}"
        ) from None


def writable_file(path: str) -> str:
    """A file path whose directory exists and may be written: checked before the worker
    starts, not found out once a second by every loop iteration that touches it."""
    if not path or "\x00" in path:
        raise argparse.ArgumentTypeError("must be a file path")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise argparse.ArgumentTypeError(f"the directory {printable(directory)!r} does not exist")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"the directory {printable(directory)!r} is not writable")
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{printable(path)!r} is a directory")
    return path


def processes(maximum: int) -> Callable[[str], int]:
    """``auto`` (this machine's cores) or a whole number of processes in ``[1, maximum]``."""

    def parse(text: str) -> int:
        if text == "auto":
            return max(1, min(os.cpu_count() or 1, maximum))
        try:
            value = int(text)
        except ValueError:
            value = 0
        if not 1 <= value <= maximum:
            raise argparse.ArgumentTypeError(
                f"must be auto or a whole number from 1 to {maximum}, not {printable(text)[:40]!r}"
            )
        return value

    return parse
