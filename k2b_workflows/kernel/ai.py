"""Durable AI tasks: created once per step, run by workers, cancelable.

The task is keyed by the step's ``effect_key`` and charged one ``max_ai_calls``
unit when it is created; a replay finds it and pays nothing. The step waits
on ``("k2b.ai_task", effect_key)``; the task's result wakes it. After a
cancellation the result is discarded and wakes nothing.

A worker calls the provider only with a request the kernel wrote (#35): the
runtime role can INSERT a ``k2b_ai_task`` row, or rewrite a queued one's
request, and the next AI worker would send it, paid and with the app's
credentials. ``request_seal`` is an HMAC under the evidence key over the
request and whose it is (effect key, run, step, app, provider); a task whose
seal does not match fails without a call, with an ERROR line.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from django.db import connections, transaction

from .. import codes, redaction, settings
from ..actions import Dependency, Result, failed, succeeded, waiting
from ..exceptions import InvalidInput
from ..validation import canonical_json, to_json_value
from . import budgets, db, hashing, waits
from .db import holding_run_lock
from .seals import seal_of, text_problem

if TYPE_CHECKING:
    from ..actions import StepContext

logger = logging.getLogger(__name__)

KIND = "k2b.ai_task"

Provider = Callable[[Any, threading.Event], Any]
_providers: dict[str, Provider] = {}


def ai_provider(name: str) -> Callable[[Provider], Provider]:
    """Register ``fn(request, abort) -> result`` as the provider ``name``.

    ``abort`` is a ``threading.Event`` set when the run is canceled or the
    task's lease is lost: long calls should check it and stop.
    """
    if not isinstance(name, str) or not name:
        raise InvalidInput("ai_provider() takes a non-empty name")

    def register(fn: Provider) -> Provider:
        _providers[name] = fn
        return fn

    return register


def providers() -> dict[str, Provider]:
    return dict(_providers)


def _request_text(
    effect_key: str, run_id: Any, seq: int, app_id: str, provider: str, request: Any
) -> str:
    return hashing.canonical(
        ["ai_request", effect_key, str(run_id), int(seq), app_id, provider, request]
    )


def request_seal(
    effect_key: str, run_id: Any, seq: int, app_id: str, provider: str, request: Any
) -> str:
    """The seal a task's request is written with (the kernel holds the key)."""
    return seal_of(_request_text(effect_key, run_id, seq, app_id, provider, request))


def request_problem(
    sealed: str, effect_key: str, run_id: Any, seq: int, app_id: str, provider: str, request: Any
) -> str | None:
    """Why a task's request was not written by the kernel, or None."""
    text = _request_text(effect_key, run_id, seq, app_id, provider, request)
    why = text_problem(sealed, text)
    if why is None:
        return None
    return f"its request (or whose step it is) {why}: it was not written by the kernel"


#: The AI task this step created, if any (a step resumed after a crash finds it).
_TASK_OF_STEP_SQL = "SELECT status, result, error_message FROM k2b_ai_task WHERE effect_key = %s"

_INSERT_TASK_SQL = """
INSERT INTO k2b_ai_task (id, run_id, seq, app_id, effect_key, provider, request,
    request_seal, status, attempts, generation, created_at, updated_at,
    error_message)
VALUES (gen_random_uuid(), %s, %s, %s, %s, %s, %s, %s, 'queued', 0, 0,
        k2b_now(), k2b_now(), '')
"""


def step_task(ctx: StepContext, provider: str, request: Any) -> Result:
    if provider not in _providers:
        return failed(f"no AI provider {provider!r} is registered", code="UNKNOWN_AI_PROVIDER")
    try:
        request = to_json_value(request, "the AI request")
    except InvalidInput as exc:
        # Produced inside the run: a clean step failure, not an exception from run().
        return failed(str(exc), code=codes.AI_TASK_FAILED)
    using = ctx.using
    with transaction.atomic(using=using), holding_run_lock():
        db.fence(using, ctx.run_id, ctx.generation, settings.lease_ms())
        rows = db.fetchall(
            using,
            _TASK_OF_STEP_SQL,
            [ctx.effect_key],
        )
        if not rows:
            try:
                budgets.charge_ai_call(
                    using, root_id=ctx.root_run_id, run_id=ctx.run_id, seq=ctx.step
                )
            except budgets.BudgetExceeded as exc:
                return failed(str(exc), code=exc.code)
            db.execute(
                using,
                _INSERT_TASK_SQL,
                [
                    ctx.run_id,
                    ctx.step,
                    ctx.app_id,
                    ctx.effect_key,
                    provider,
                    canonical_json(request),
                    request_seal(
                        ctx.effect_key, ctx.run_id, ctx.step, ctx.app_id, provider, request
                    ),
                ],
            )
            return waiting(Dependency(KIND, ctx.effect_key))
        status, result, error = rows[0]
    if status == "succeeded":
        return succeeded(db.from_json(result))
    if status == "failed":
        return failed(error or "the AI task failed", code=codes.AI_TASK_FAILED)
    if status == "canceled":
        return failed("the AI task was canceled", code=codes.CANCELED)
    return waiting(Dependency(KIND, ctx.effect_key))


_CLAIM_SQL = """
UPDATE k2b_ai_task t
   SET status = 'running', generation = t.generation + 1, attempts = t.attempts + 1,
       lease_expires_at = k2b_now() + %s * interval '1 millisecond', updated_at = k2b_now()
 WHERE t.id IN (SELECT id FROM k2b_ai_task
                 WHERE status = 'queued' AND provider = ANY(%s) {app_filter}
                 ORDER BY created_at LIMIT %s FOR UPDATE SKIP LOCKED)
RETURNING t.id, t.generation, t.provider, t.request, t.app_id, t.effect_key,
          t.request_seal, t.run_id, t.seq
"""


def claim_tasks(using: str, *, app_ids: list[str] | None, limit: int) -> list[tuple]:
    names = list(_providers)
    if limit <= 0 or not names:
        return []
    params: list[Any] = [settings.lease_ms(), names]
    app_filter = ""
    if app_ids:
        app_filter = "AND app_id = ANY(%s)"
        params.append(list(app_ids))
    params.append(limit)
    with connections[using].cursor() as cursor:
        cursor.execute(_CLAIM_SQL.format(app_filter=app_filter), params)
        return cursor.fetchall()


_REAP_TASKS_SQL = """
UPDATE k2b_ai_task t
      SET status = CASE WHEN t.attempts >= %s THEN 'failed' ELSE 'queued' END,
          error_message = CASE WHEN t.attempts >= %s
              THEN 'gave up after ' || t.attempts || ' attempts: each time the worker '
                   'lost the task before storing an answer (AI_TASK_MAX_ATTEMPTS)'
              ELSE t.error_message END,
          finished_at = CASE WHEN t.attempts >= %s THEN k2b_now() END,
          lease_expires_at = NULL, updated_at = k2b_now()
    WHERE t.id IN (SELECT id FROM k2b_ai_task WHERE status = 'running'
                    AND lease_expires_at < k2b_now()
                    LIMIT 500 FOR UPDATE SKIP LOCKED)
RETURNING t.status, t.app_id, t.effect_key
"""


def reap_expired(using: str) -> int:
    """A worker died while running a provider: queue the task again, a bounded number of times.

    ``attempts`` counts claims. A provider whose call kills or freezes the
    worker (or whose answer could not be written) would otherwise be called,
    and paid, on every lease expiry forever: after ``AI_TASK_MAX_ATTEMPTS``
    the task fails and wakes its step, which fails ``AI_TASK_FAILED``.
    """
    limit = settings.ai_task_max_attempts()
    rows = db.fetchall(
        using,
        _REAP_TASKS_SQL,
        [limit, limit, limit],
    )
    for status, app_id, effect_key in rows:
        if status == "failed":
            waits.wake(using, app_id=app_id, kind=KIND, key=effect_key)
    return len(rows)


_FINISH_TASK_SQL = """
UPDATE k2b_ai_task SET status = %s, result = %s, error_message = %s,
      finished_at = k2b_now(), updated_at = k2b_now(), lease_expires_at = NULL
WHERE id = %s AND generation = %s AND status = 'running'
"""


def run_task(using: str, task: tuple, abort: threading.Event) -> str:
    """Call the provider and store its result, unless the task was canceled meanwhile."""
    task_id, generation, provider, request, app_id, effect_key, sealed, run_id, seq = task
    try:
        request = db.from_json(request)
        forged = request_problem(sealed, effect_key, run_id, seq, app_id, provider, request)
        if forged is not None:
            # Sending it would spend the app's credentials on a stranger's prompt.
            logger.error(
                "AI task %s (%s) refused, the provider was not called: %s",
                task_id,
                provider,
                forged,
            )
            output, status, error = None, "failed", f"refused: {forged}"
        else:
            output = to_json_value(_providers[provider](request, abort), f"{provider} result")
            status, error = "succeeded", ""
    except Exception as exc:
        logger.warning("AI task %s (%s) failed: %r", task_id, provider, exc)
        output, status, error = None, "failed", redaction.scrub_error(exc)

    def finish() -> int:
        updated = db.execute(
            using,
            _FINISH_TASK_SQL,
            [
                status,
                None if output is None else canonical_json(output),
                error,
                task_id,
                generation,
            ],
        )
        if updated:
            waits.wake(using, app_id=app_id, kind=KIND, key=effect_key)
        return updated

    if not db.run_in_transaction(finish, using):
        logger.info("AI task %s: result discarded (canceled or taken over)", task_id)
        return "discarded"
    return status
