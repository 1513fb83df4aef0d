"""The soak's report: a table to read and one JSON line (``SOAK {...}``) to keep."""

from __future__ import annotations

import json
from typing import Any

from .invariants import INVARIANTS


def say(line: str = "") -> None:
    print(line, flush=True)


def shown(item: Any) -> str:
    """A finding as one line to read: times in ISO 8601, ids as text."""
    if isinstance(item, dict):
        return json.dumps(item, default=str)
    if isinstance(item, tuple | list):
        return "(" + ", ".join(str(value) for value in item) + ")"
    return str(item)


def print_report(report: dict[str, Any]) -> None:
    say()
    say(f"| soak ({report['mode']}) | |")
    say("|---|---|")
    for key in (
        "runs_started",
        "tasks_enqueued",
        "tasks_enqueued_by",
        "hogs",
        "hogs_held",
        "scheduled_ticks",
        "runs_total",
        "statuses",
        "outcomes_not_succeeded",
        "provider_calls",
        "task_calls",
        "effects",
        "claims",
        "worker_processes",
        "kills",
        "freezes",
        "freezes_past_lease",
        "terminations",
        "restart_modes",
        "burners",
        "burned_seconds",
        "lease_ms",
        "worker_nice",
        "seconds",
    ):
        say(f"| {key} | {report[key]} |")
    say(
        f"| needs_attention (EXTERNAL, no reconcile, outcome unknown) | "
        f"{report['needs_attention']}, calls per step: {report['needs_attention_calls']}, "
        f"cut by: {report['needs_attention_cut_by']} |"
    )
    say(
        f"| takeovers (of live holders) | {report['takeovers']} ({report['live_takeovers']}:"
        f" {report['live_kernel_saw_alive']} known alive to the reap,"
        f" {report['live_in_external_call']} inside an external call,"
        f" {report['live_in_external_step']} between a dispatch and its end;"
        f" ended wrongly {report['live_ended_wrongly']}, repeated {report['live_repeated']},"
        f" raced {report['live_raced']}) |"
    )
    say()
    say("| invariant | value |")
    say("|---|---|")
    for key in INVARIANTS:
        say(f"| {key} | {report[key]}{'' if report[key] == 0 else '  <-- VIOLATED'} |")
    say()
    say("SOAK " + json.dumps(report, sort_keys=True, default=str))
