"""Which runs have no code to continue on: pinned versions in a rolling deploy.

A run is pinned to the (name, version) it started with, and only a process
that registered that pair claims it. A run whose version no process has
would wait silently forever; these functions name it instead, for the admin
and the management commands.

Without ``live=`` they answer for *this process's* registry; given the
(name, version) pairs of the live workers (``live_pairs()``, from the
heartbeats in ``k2b_worker``) they answer for the fleet, which is what the
admin and ``manage.py workflowruns`` show.

The registry of versions is a definition (``workflows.py``); which runs lack
code is a question about the runs and the fleet, so this module sits above the
models and ``fleet.py``, beside the other operators' reads.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from django.db.models import Q, QuerySet

from .fleet import live_workers
from .models import TERMINAL_STATUSES, WorkflowRun
from .workflows import registered_versions

Pair = tuple[str, int]


def registered_pairs() -> set[Pair]:
    """The (name, version) pairs this process can run."""
    return {(d.name, d.version) for d in registered_versions()}


def live_pairs(using: str | None = None) -> set[Pair]:
    """The (name, version) pairs some live worker can claim, from the workers' heartbeats."""
    return {(c["name"], int(c["version"])) for w in live_workers(using) for c in w["workflows"]}


def missing_code_reason(
    workflow_name: str, version: int, *, live: Collection[Pair] | None = None
) -> str:
    """Why no worker can continue a run of (``workflow_name``, ``version``); "" if one can.

    Without ``live`` the answer is about this process's registry; with the
    pairs of the live workers it is about the fleet. No pair at all means no
    worker is running, and saying that a version is missing would send the
    reader after a deploy problem that is not there.
    """
    if live is not None:
        live = set(live)
        if (workflow_name, version) in live:
            return ""
        if not live:
            return "no worker is running"
        return f"no live worker has code for version {version}"
    if (workflow_name, version) in registered_pairs():
        return ""
    return f"no registered code for version {version} in this process"


def runs_missing_code(
    runs: QuerySet[WorkflowRun] | None = None, *, live: Collection[Pair] | None = None
) -> QuerySet[WorkflowRun]:
    """Unfinished runs whose (name, version) has no code here (or on any live worker)."""
    pairs = registered_pairs() if live is None else set(live)
    runs = WorkflowRun.objects.all() if runs is None else runs
    runs = runs.exclude(status__in=TERMINAL_STATUSES)
    if not pairs:
        return runs
    known = Q()
    for name, version in pairs:
        known |= Q(workflow_name=name, workflow_version=version)
    return runs.exclude(known)


def run_code_note(run: Any, *, live: Collection[Pair] | None = None) -> str:
    """The reason for an unfinished run, "" for a finished one or one that has code."""
    if run.status in TERMINAL_STATUSES:
        return ""
    return missing_code_reason(run.workflow_name, run.workflow_version, live=live)
