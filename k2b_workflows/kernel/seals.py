"""Keyed seals over the run row's own fields: what decides an effect, and how the run ended.

The failure this is built around: the chains cover the journal and the
ledger, but the run row holds what the steps are computed from (its input,
principal, version, idempotency key, place in a tree) and what callers and
parents read as its result (status, output, error code). The runtime role
updates run rows: without a seal, it changed a queued run's input from 99 to
999 and the run charged 999, replaced a succeeded run's output, and set an
incident straight to ``succeeded`` with no resolution in the ledger; all of
that passed ``verifyworkflows``.

- ``start_seal`` = HMAC over the fields fixed at start, written with the run.
  A claim checks it before any step sees the input (``kernel/execute.py``).
- ``end_seal`` = HMAC over (status, output, error code, generation), written
  in the statement that ends the run, parks it for an operator or cancels it;
  cleared when the run is queued again. The generation makes an old seal
  useless on a later life of the run (generation never decreases).

- ``attempts_seal`` = HMAC over (run id, ``attempts_seq``), written by every
  reset of the run's failure count (#47): a completed step after failures, a
  park, an operator's retry or resolution. The database refuses a lower count
  that does not come with a higher ``attempts_seq`` (``models.WorkflowRun``'s
  triggers), and a number that decreases; so a count set back to 0 by the
  runtime role carries either the old number (refused) or a new one no key
  sealed, which the claim refuses before a step runs. Resetting the counter
  as the runtime role ran a step bounded to 3 attempts 213 times before.

All three are ``"<key id>:<mac>"`` under the evidence keys (``keys.evidence_keys()``),
which live outside the database: a role that can write the row cannot make
a seal that verifies. ``verifyworkflows``, the admin and a parent reading its
children's results check them.
"""

from __future__ import annotations

import hmac
import uuid
from typing import Any

from ..models import WorkflowRun
from . import hashing
from .keys import evidence_keys

#: Statuses whose row carries an end seal: the run ended, or waits for an operator.
SEALED_STATUSES = frozenset({"succeeded", "failed", "canceled", "needs_attention"})


class SealBroken(Exception):
    """A run's sealed fields do not match their seal: the run must not be used."""


def _mac(key_id: str, key: bytes, text: str) -> str:
    return f"{key_id}:{hashing.hmac_hex(key, text)}"


def _start_text(run: WorkflowRun, *, routed: bool = True) -> str:
    return _start_text_of(run, run.pk, run.root_id, run.input, routed=routed)


def _start_text_of(
    run: WorkflowRun,
    run_id: Any,
    root_id: Any,
    input: Any,
    *,
    routed: bool = True,
    fairness: tuple[str, float] | None = None,
) -> str:
    """What a start seal covers. ``routed``: with where and in which order the run is
    claimed, its queue, priority and task path (#47): a task moved to another queue
    never ran on its queue's workers, and the runs list showed a forged task path.
    Seals written before #47 cover the rest only (``start_problem``). ``getattr``: a
    migration seals rows of a model from before those columns (their defaults)."""
    fields = [
        "start",
        str(run_id),
        run.workflow_name,
        run.workflow_version,
        run.app_id,
        input,
        run.principal,
        run.idempotency_key,
        None if run.parent_id is None else str(run.parent_id),
        None if root_id is None else str(root_id),
        run.parent_step,
        run.child_index,
    ]
    if routed:
        fields += [
            getattr(run, "queue", "default"),
            getattr(run, "priority", 0),
            getattr(run, "priority_credit_ms", 0),
            getattr(run, "task_path", ""),
        ]
    forked_from = getattr(run, "forked_from_id", None)
    if forked_from is not None:
        # Only a fork's seal covers it: every other run's seal text is as before.
        fields.append(["forked_from", str(forked_from)])
    key = getattr(run, "fairness_key", None)
    if fairness is None and key is not None:
        fairness = (key, run.fairness_weight)
    if fairness is not None:
        # Only the seal of a run that takes turns covers its key and weight: where it
        # stands in line, as its priority (every other run's seal text is as before).
        fields.append(["fairness", fairness[0], float(fairness[1])])
    return hashing.canonical(fields)


def _end_text(
    run_id: uuid.UUID, status: str, output_text: str, error_code: str, generation: int
) -> str:
    head = hashing.canonical(["end", str(run_id), status, error_code or "", int(generation)])
    return f"{head}\n{output_text}"


def start_seal(run: WorkflowRun) -> str:
    """The seal a new run is written with (every start field set, ``root_id`` too)."""
    key_id, key = hashing.signing_key()
    return _mac(key_id, key, _start_text(run))


def start_seal_like(
    template: WorkflowRun,
    run_id: uuid.UUID,
    input: Any,
    *,
    fairness: tuple[str, float] | None = None,
) -> str:
    """``start_seal`` of a root run that differs from ``template`` (a root run) only by its
    id (its own root), input and, where the template takes turns, ``fairness`` (its
    key and weight): ``starts.start_many`` seals thousands of rows so, without
    building a model instance for each."""
    key_id, key = hashing.signing_key()
    return _mac(key_id, key, _start_text_of(template, run_id, run_id, input, fairness=fairness))


def end_seal(
    run_id: uuid.UUID, status: str, error_code: str, generation: int, output_text: str = "null"
) -> str:
    """The seal of a run's end; ``output_text`` is the canonical JSON of its output."""
    key_id, key = hashing.signing_key()
    return _mac(key_id, key, _end_text(run_id, status, output_text, error_code, generation))


def _attempts_text(run_id: Any, seq: int) -> str:
    return hashing.canonical(["attempts", str(run_id), int(seq)])


def attempts_seal(run_id: Any, seq: int) -> str:
    """The seal of a run's ``attempts_seq`` ``seq``: a reset of its failures the kernel made."""
    key_id, key = hashing.signing_key()
    return _mac(key_id, key, _attempts_text(run_id, seq))


def attempts_problem(run: WorkflowRun, keys: dict[str, bytes] | None = None) -> str | None:
    """Why the run's failure count cannot be trusted, or None.

    Number 0 needs no seal: it is where every run starts, and a count can only
    have risen under it. Any other number is one the kernel sealed, or forged.
    """
    if not run.attempts_seq:
        return None
    keys = keys if keys is not None else dict(evidence_keys())
    why = _matches(run.attempts_seal, _attempts_text(run.pk, run.attempts_seq), keys)
    if why is None:
        return None
    return (
        f"the run's failure count (reset number {run.attempts_seq}) {why}: it was set back"
        " outside the kernel, which alone decides how often a step may run again"
    )


def _limits_text(root_id: Any, effect_budget: Any, max_ai_calls: Any, max_steps: Any) -> str:
    return hashing.canonical(["limits", str(root_id), effect_budget or {}, max_ai_calls, max_steps])


def limits_seal(root_id: Any, effect_budget: Any, max_ai_calls: Any, max_steps: Any) -> str:
    """The seal of a root's budget limits (``BudgetAccount.limits_seal``)."""
    key_id, key = hashing.signing_key()
    return _mac(key_id, key, _limits_text(root_id, effect_budget, max_ai_calls, max_steps))


def limits_problem(
    root_id: Any, effect_budget: Any, max_ai_calls: Any, max_steps: Any, sealed: str
) -> str | None:
    """Why a root's budget limits cannot be trusted (changed since the run started), or None."""
    why = _matches(
        sealed,
        _limits_text(root_id, effect_budget, max_ai_calls, max_steps),
        dict(evidence_keys()),
    )
    if why is None:
        return None
    return (
        f"the budget limits of {root_id} (effect_budget {effect_budget or {}}, max_ai_calls"
        f" {max_ai_calls}, max_steps {max_steps}) {why}: changed after the run started"
    )


def _matches(sealed: str, text: str, keys: dict[str, bytes]) -> str | None:
    """None when ``sealed`` is a seal of ``text`` under one of ``keys``, else why not."""
    if not sealed:
        return "has no seal"
    key_id, _, _ = sealed.partition(":")
    key = keys.get(key_id)
    if key is None:
        return f"is sealed with key id {key_id!r}, which no evidence key has"
    if not hmac.compare_digest(_mac(key_id, key, text), sealed):
        return "does not match its seal"
    return None


def seal_of(text: str) -> str:
    """A seal of ``text`` under the signing key: for any row the kernel seals (schedules,
    AI task requests), each with a text of its own kind."""
    key_id, key = hashing.signing_key()
    return _mac(key_id, key, text)


def text_problem(sealed: str, text: str) -> str | None:
    """None when ``sealed`` is a seal of ``text`` under one of the evidence keys, else why not."""
    return _matches(sealed, text, dict(evidence_keys()))


def start_problem(run: WorkflowRun, keys: dict[str, bytes] | None = None) -> str | None:
    """Why the run's start fields cannot be trusted, or None.

    A seal written before #47 does not cover the run's queue, priority and task
    path: it verifies over the other fields alone. A seal written since covers them
    all, and never verifies over fewer (it is a MAC of the longer text).
    """
    keys = keys if keys is not None else dict(evidence_keys())
    why = _matches(run.start_seal, _start_text(run), keys)
    if why is None or _matches(run.start_seal, _start_text(run, routed=False), keys) is None:
        return None
    return (
        f"the run's start fields (input, principal, version, idempotency key, tree, queue,"
        f" priority, task path, fork link) {why} (changed after the run was started)"
    )


def end_problem(run: WorkflowRun, keys: dict[str, bytes] | None = None) -> str | None:
    """Why the run's recorded end (status, output, error code) cannot be trusted, or None."""
    if run.status not in SEALED_STATUSES:
        return None
    keys = keys if keys is not None else dict(evidence_keys())
    text = _end_text(
        run.pk, run.status, hashing.canonical(run.output), run.error_code, run.generation
    )
    why = _matches(run.end_seal, text, keys)
    if why is None:
        return None
    return (
        f"the run's end ({run.status}"
        + (f", {run.error_code}" if run.error_code else "")
        + f", its output) {why}: it was not ended by the kernel or an operator's resolution"
    )


def problem(run: WorkflowRun, keys: dict[str, bytes] | None = None) -> str | None:
    """The first problem with any seal of ``run``, or None."""
    keys = keys if keys is not None else dict(evidence_keys())
    return start_problem(run, keys) or attempts_problem(run, keys) or end_problem(run, keys)
