"""What an operator is told when a run's code no longer matches its history.

A run replays on the code of its own (name, version). When that code asks for
another step than the journal holds, or than the run parked on, or raises by
itself, the run stops before any effect and waits for an operator
(``WORKFLOW_NONDETERMINISTIC``, ``WORKFLOW_CODE_ERROR``). The incidents here
say what differs, as names and hashes only: never the inputs themselves.
"""

from __future__ import annotations

import traceback
from typing import Any

from .. import redaction
from ..models import JournalEntry

#: Journal entries named ``k2b.patch:<id>`` record that a run took a patch.
PATCH_KIND = "k2b.patch"
#: A workflow's traceback is kept for the operator up to this length (its end).
MAX_TRACEBACK_CHARS = 6000

Incident = tuple[str, dict[str, Any]]


def journaled_step_changed(
    entry: JournalEntry, name: str, input_hash: str, version: int
) -> Incident:
    """The code asks at ``entry``'s position for another action or input than journaled."""
    seq = entry.seq
    if entry.action_name != name:
        message = f"step {seq} was {entry.action_name!r} when journaled, now {name!r}"
    else:
        message = f"step {seq} ({name}) was journaled with another input (hash differs)"
    marker = f"{PATCH_KIND}:"
    if entry.action_name.startswith(marker) and not name.startswith(marker):
        patch_id = entry.action_name[len(marker) :]
        message += (
            f"; the run took patch {patch_id!r} here: keep run.patched({patch_id!r}) or"
            f" run.deprecate_patch({patch_id!r}) at this point"
        )
    detail = {
        "kind": "nondeterminism",
        "seq": seq,
        "journaled": {
            "action": entry.action_name,
            "effect": entry.effect,
            "state": entry.state,
            "input_hash": entry.input_hash,
        },
        "asked": {"action": name, "input_hash": input_hash},
        "workflow_version": version,
    }
    return message, detail


def parked_step_changed(
    seq: int, parked: str, name: str, input_hash: str, version: int
) -> Incident:
    """The run parked at ``seq`` on action ``parked``; the code now asks for ``name`` there."""
    detail = {
        "kind": "nondeterminism",
        "seq": seq,
        "parked": {"action": parked},
        "asked": {"action": name, "input_hash": input_hash},
        "workflow_version": version,
    }
    message = (
        f"step {seq} was {parked!r} when the run parked there, now {name!r}: put the "
        "change behind run.patched(...) or start a new version"
    )
    return message, detail


def code_error(exc: Exception, version: int) -> Incident:
    """The workflow function itself raised: its bug, with its (redacted) traceback."""
    # Credentials in URLs and key=value pairs are removed, as from every stored text.
    text = redaction.redact_text("".join(traceback.format_exception(exc)))
    if len(text) > MAX_TRACEBACK_CHARS:
        text = "… (truncated)\n" + text[-MAX_TRACEBACK_CHARS:]
    detail = {
        "kind": "code_error",
        "exception": type(exc).__name__,
        "traceback": text,
        "workflow_version": version,
    }
    return f"workflow code raised {type(exc).__name__}: {exc}"[:1000], detail
