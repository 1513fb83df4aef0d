"""Keyed seals over schedule rows: a pass fires only what the key holder wrote.

The failure this is built around: a run's start seal covers what the runtime
role writes *as a run*, but a schedule pass starts runs from ``k2b_schedule``
rows and seals them itself. The runtime role (an SQL injection in the host
app) INSERTed a row naming a charge workflow with input 99999, due now; the
next pass started the run and sealed it with the evidence key, and
``verifyworkflows`` found nothing. Renaming an operator's ``schedule_id`` and
rewinding its next tick fired a tick again under a fresh idempotency key.

So every column that decides what a pass starts, with what input, or when
(``SEALED_FIELDS``: the spec, the input, the workflow, paused/enabled and the
tick bookkeeping) is covered by ``seal``, an HMAC under the evidence key
(``keys.evidence_keys()``, held outside the database). Its writers all hold
the key: ``WorkflowSchedule.save`` (``migrate``'s decorator schedules,
``schedule_workflow``, the admin) and the passes, which reseal the row they
move on. A pass refuses a row whose seal does not match: no run, an ERROR
line, the row disabled *without* a new seal (it stays tampered until the key
holder writes it again); ``verifyworkflows`` and the admin name it.

What a seal cannot tell: an older state the key holder really wrote, written
back whole (seal included). Its ticks were fired already, and each tick's run
has the unique key ``schedule:<schedule_id>:<tick>``: the pass finds the run
there and starts nothing.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

from . import hashing
from .seals import seal_of, text_problem

#: The columns that decide what a pass starts and when, in the order the seal covers them.
SEALED_FIELDS: tuple[str, ...] = (
    "schedule_id",
    "workflow_name",
    "workflow_version",
    "cron",
    "every",
    "timezone",
    "input",
    "catch_up",
    "overlap",
    "jitter",
    "paused",
    "enabled",
    "anchor",
    "next_tick",
    "next_fire_at",
    "last_tick",
    "buffered_tick",
    "resumed_at",
)

#: What ``disabled_reason`` starts with when a pass refused a row for its seal.
TAMPERED = "tampered"


def _plain(value: Any) -> Any:
    """A column's value as the seal's JSON holds it, the same read from Python or SQL."""
    if isinstance(value, dt.timedelta):
        return ["interval", value // dt.timedelta(microseconds=1)]
    if isinstance(value, dt.datetime):
        return ["instant", value.astimezone(dt.UTC).isoformat()]
    return value


def _text(values: Mapping[str, Any]) -> str:
    return hashing.canonical(["schedule", *(_plain(values[name]) for name in SEALED_FIELDS)])


def seal(values: Mapping[str, Any]) -> str:
    """The seal of a schedule row holding ``values`` (every ``SEALED_FIELDS`` name)."""
    return seal_of(_text(values))


def problem(values: Mapping[str, Any], sealed: str) -> str | None:
    """Why the schedule row holding ``values`` was not written by the key holder, or None."""
    why = text_problem(sealed, _text(values))
    if why is None:
        return None
    return (
        f"its spec, input, workflow or ticks {why}: it was not written by migrate,"
        " schedule_workflow(), the admin or a schedule pass"
    )


def of_row(row: Any) -> dict[str, Any]:
    """``SEALED_FIELDS`` of an object holding them as attributes (a model, a pass's row)."""
    return {name: getattr(row, name) for name in SEALED_FIELDS}
