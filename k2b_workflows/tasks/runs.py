"""The worker side of django.tasks: a task call is a run of a one-step workflow.

The failure this is built around: a job system that, after its worker died,
runs a task again without knowing whether its effect already happened (a
card charged twice), or never again though nothing happened. Here each
effect a task may declare is one workflow (``k2b.task.pure``,
``k2b.task.idempotent``, ``k2b.task.external``) whose single step calls the
task's function under that effect class, so the kernel's crash semantics
are the task's: a pure task runs again, an idempotent one runs again with
the same ``effect_key``, an external one is never run again after its
dispatch was recorded (``needs_attention``, settled by ``resolve_effect``).

The task's function is imported by path inside the step, on the worker: a
module that no longer imports, or a path that no longer names the task
enqueued (renamed, or another task took its name), fails the run with a
code of its own before anything is called. An exception raised by the task
fails it (``TASK_FAILED``), retried only under the task's ``Retry``; each
failed call leaves a ``TaskAttempt`` row, written fenced, for
``TaskResult.errors``. A successful call writes nothing of its own: its
success rides on the run's end, one commit.
"""

from __future__ import annotations

import contextvars
import datetime as dt
import importlib
import inspect
import logging
import traceback
from typing import Any

from django.core.signals import setting_changed
from django.db import connections
from django.utils import timezone
from django.utils.module_loading import import_string

from .. import codes, settings
from ..actions import (
    Action,
    Effect,
    Failed,
    Succeeded,
    Unknown,
    failed,
    succeeded_as_stored,
    unknown,
)
from ..exceptions import InvalidInput, LeaseLost, RunCanceled, StepFailed
from ..fairness import check_weight
from ..fairness import key_text as fairness_key_text
from ..kernel import clock, hooks, interventions, seals, starts, uniques
from ..kernel.budgets import CostRefused
from ..kernel.hashing import canonical
from ..models import LedgerEntry, RunStatus, TaskAttempt, WorkflowRun
from ..redaction import scrub_error
from ..validation import to_json_value
from ..workflows import RunHandle, workflow
from .compat import InvalidTask as InvalidTask
from .compat import TaskResultDoesNotExist as TaskResultDoesNotExist
from .compat import TaskResultMismatch as TaskResultMismatch
from .compat import backends_api as backends_api
from .compat import base_api, signals_api
from .compat import exceptions_api as exceptions_api
from .compat import tasks_api as tasks_api
from .exceptions import TaskTimeout
from .names import EFFECT_OF_WORKFLOW, PRIORITY_OFFSET, TASK_APP_ID, WORKFLOW_NAMES
from .options import BACKOFF_ON_TASK, MAX_BACKOFF_S, call_cost, check_input, input_option

# The names of ``compat`` imported ``as`` themselves are those ``k2b_workflows.taskruns``
# had: its old path gives this module for a release (``moved.MOVED``).

logger = logging.getLogger(__name__)


#: The effect class of each effect a task may declare.
EFFECTS = {"pure": Effect.PURE, "idempotent": Effect.IDEMPOTENT, "external": Effect.EXTERNAL}

#: The step context of the task this thread is running: what ``effect_key(context)`` reads.
current_step: contextvars.ContextVar[Any] = contextvars.ContextVar("k2b_task_step", default=None)

#: run id -> (the result its last attempt in this process saw, its return value or None,
#: the sender its ``task_started`` had): ``task_finished`` is built from it when the
#: run's end commits, with no query and no second look-up of the task's backend.
#: Bounded: an attempt whose run ends elsewhere (a retry on another worker) is dropped.
last_attempts: dict[Any, tuple[Any, Any, type]] = {}
MAX_REMEMBERED = 10_000

#: run id (as ``TaskResult.id``) -> the step context of its call running in this process:
#: what ``is_cancel_requested(context)`` asks, from whichever thread the task passes it to.
running_calls: dict[str, Any] = {}


def remember(run_id: Any, result: Any, value: Any, sender: type) -> None:
    last_attempts.pop(run_id, None)
    while len(last_attempts) >= MAX_REMEMBERED:
        last_attempts.pop(next(iter(last_attempts)))
    last_attempts[run_id] = (result, value, sender)


def finished_result(run_id: Any, status: str) -> tuple[Any, type, BaseException | None] | None:
    """The finished task's result from what its last attempt here saw, the sender of
    its signals (the class of the task's backend), and the exception that failed it
    (None: it succeeded, or failed otherwise); None: nothing seen."""
    seen = last_attempts.pop(run_id, None)
    if seen is None:
        return None
    result, value, sender = seen
    # Finished in place, as Django's own backends finish the result their task ran
    # with: a copy (``dataclasses.replace``) normalized its arguments again.
    statuses = base_api.TaskResultStatus
    succeeded = status == RunStatus.SUCCEEDED
    object.__setattr__(result, "status", statuses.SUCCESSFUL if succeeded else statuses.FAILED)
    object.__setattr__(result, "finished_at", timezone.now())
    if succeeded:
        object.__setattr__(result, "_return_value", value)
    error = value if not succeeded and isinstance(value, BaseException) else None
    return result, sender, error


class TaskUnavailable(Exception):
    """The enqueued path does not lead to the task on this worker."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def load_task(path: str) -> Any:
    """The ``Task`` at ``path``, checked to be the task enqueued there.

    A path that now names another function (a rename, another task taking the
    name) is refused rather than called: an effect must not run under the
    wrong code.
    """
    module_name, _, attr = path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise TaskUnavailable(
            codes.TASK_IMPORT_FAILED,
            f"task {path}: its module {module_name!r} does not import on this worker: "
            f"{type(exc).__name__}: {exc}",
        ) from exc
    task = getattr(module, attr, None)
    if not isinstance(task, base_api.Task):
        raise TaskUnavailable(
            codes.TASK_NOT_FOUND,
            f"task {path}: module {module_name!r} has no task {attr!r} (renamed or removed "
            "since it was enqueued?)",
        )
    if task.module_path != path:
        raise TaskUnavailable(
            codes.TASK_NOT_FOUND,
            f"task {path}: that name now holds the task {task.module_path} (renamed since it "
            "was enqueued?): not called",
        )
    return task


# -- what the run's input says of its task ------------------------------------------


def run_columns(input: Any) -> dict[str, Any]:
    """The start columns of a task's run, read from its input (``starts.INPUT_COLUMNS``).

    Whoever starts the run (an enqueue, a schedule's tick, the admin's "run
    now") it lands on its task's queue, with its task's priority (Django's
    -100..100 on the kernel's 0..200), task path and concurrency: the input is
    sealed with the run, and nothing else a starter passes can differ from it.
    A task's concurrency key is its path: ``Concurrency(limit=1)`` on a task
    means one call of it at a time across every worker. Its ``effect_budget``
    is its run's budget account's (a task's run is its own root), written with
    the run, out of the runtime role's reach (``roles.py``).
    """
    check_input(input)
    path = input_option(input, "path")
    queue = input_option(input, "queue")
    priority = input_option(input, "priority")
    declared = input_option(input, "concurrency")
    return {
        "queue": queue,
        "priority": priority + PRIORITY_OFFSET,
        "task_path": path,
        "concurrency": declared,
        "concurrency_key": None if declared is None else f"task:{path}",
        "effect_budget": input_option(input, "effect_budget"),
        "fairness": _fairness_of(input),
    }


def _fairness_of(input: Any) -> tuple[str, float] | None:
    """The key and weight by which a call takes turns (``Fairness``), as its input
    holds them (``WorkflowsBackend.run_input``), checked; None: it takes none."""
    value = input.get("fairness")
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != {"key", "weight"}:
        raise InvalidInput(f"a task run's fairness must be {{key, weight}}, not {value!r:.80}")
    where = "a task run's fairness"
    return fairness_key_text(value["key"], where), check_weight(value["weight"], where)


def replaced_input(held: Any, call: Any, replace: bool) -> Any:
    """The input of a READY task run after a later call with its key (``Unique``):
    its task's part as it was (queue, backend, options), the call's arguments, and,
    with ``replace``, the call's priority (``kernel/uniques.py`` sets the column)."""
    input = {**held, "args": call["args"], "kwargs": call["kwargs"]}
    if replace:
        input["priority"] = call["priority"]
    return input


# -- the step -----------------------------------------------------------------------


class TaskAction(Action, abstract=True):
    """Calls the task's function; one concrete subclass per effect, path and policy."""

    #: The task's declared ``timeout`` (seconds): past it, its call failed with
    #: ``TaskTimeout``. None: none declared (the kernel's ``ACTION_TIMEOUT_MS`` still
    #: bounds how long its lease is renewed).
    task_timeout: float | None = None

    def cost(self, input: Any) -> dict[str, int]:
        """The call's charge to its run's ``effect_budget``, from its sealed input.

        The kernel charges it before the function is called (idempotent: its
        own commit; external: with the dispatch record), once per call however
        often it is retried; over budget, the call fails with
        ``EFFECT_BUDGET_EXCEEDED``. A cost that cannot be computed fails it with
        ``INVALID_TASK_COST``: its arguments will not price differently next time.
        """
        spec = input_option(input, "cost")
        if spec is None:
            return {}
        try:
            budget = input_option(input, "effect_budget")
            return call_cost(spec, input["args"], input["kwargs"], budget)
        except InvalidInput as exc:
            raise CostRefused(codes.INVALID_TASK_COST, f"task {input['task']}: {exc}") from exc

    def run(self, ctx: Any, input: Any) -> Any:
        started = timezone.now()
        run: WorkflowRun = ctx.run_row
        attempt = attempt_number(ctx, run)
        path = input["task"]
        try:
            task = load_task(path)
        except TaskUnavailable as exc:
            _record(ctx, attempt, run.claimed_by, started, exc, exc.__cause__)
            return failed(str(exc), code=exc.code)
        result = running_result(task, run, input, attempt, started)
        sender = backend_class(task)
        signals_api.task_started.send(sender=sender, task_result=result)
        token = current_step.set(ctx)
        running_calls[result.id] = ctx
        try:
            value = self._call(ctx, task, result, input)
            value = _json_return(value)
        except (LeaseLost, RunCanceled):
            raise
        except BaseException as exc:  # SystemExit and KeyboardInterrupt fail this task only
            # A cancel the lease keeper has not seen yet: read now, so that the kernel
            # ends the run canceled rather than retrying or failing it (#49).
            ctx.cancel_asked(read=True)
            error = base_api.TaskError(
                exception_class_path=f"{type(exc).__module__}.{type(exc).__qualname__}",
                traceback=_record(ctx, attempt, run.claimed_by, started, exc, exc),
            )
            result.errors.append(error)
            # Kept for the "finished" log line (``backend._finished``), its frames'
            # locals let go: remembered runs are many, a traceback's line numbers small.
            traceback.clear_frames(exc.__traceback__)
            remember(ctx.run_id, result, exc, sender)
            if isinstance(exc, TaskTimeout) and type(self).effect.is_external:
                # Its effect may have happened while it ran on: an unknown outcome (the
                # kernel's, after an exception past the dispatch): its reconcile, else
                # an operator. Never called again blindly.
                raise
            return self._failed(ctx, task, result, input, exc)
        finally:
            current_step.reset(token)
            if running_calls.get(result.id) is ctx:
                del running_calls[result.id]
        remember(ctx.run_id, result, value, sender)
        return succeeded_as_stored(value, summary=f"task {path}")

    def _call(self, ctx: Any, task: Any, result: Any, input: Any) -> Any:
        """The task's function, within its ``timeout`` if it declares one.

        A coroutine is cancelled at its timeout (``CancelledError`` at its next
        ``await``). A plain function cannot be stopped from outside its thread:
        it runs on, and once it returns (or raises) past its timeout, what it
        returned is not used: the attempt failed with ``TaskTimeout``. Meanwhile
        the kernel treats it as any action past its ``Action.timeout``: the
        worker stops renewing the run's lease at the timeout, so that a call
        that never returns does not hold its run for ever (docs/tasks.md).
        """
        args = list(input["args"])
        if task.takes_context:
            args.insert(0, base_api.TaskContext(task_result=result))
        limit = type(self).task_timeout
        started = clock.monotonic()
        try:
            value = task.func(*args, **input["kwargs"])
            if inspect.iscoroutine(value):
                # On this thread's own loop, cancelled with the run (kernel/hooks.py), and
                # asked by a cancel (#49) unless its effect is external: an external call,
                # once made, is never cut.
                external = type(self).effect.is_external
                asked = None if external else ctx.cancel_requested
                value = hooks.run_coroutine(value, ctx.abort, limit, asked=asked)
        except hooks.HookTimedOut:
            raise TaskTimeout(input["task"], limit or 0.0) from None
        except (LeaseLost, RunCanceled):
            raise
        except BaseException as exc:
            if limit is not None and clock.monotonic() - started > limit:
                raise TaskTimeout(input["task"], limit, clock.monotonic() - started) from exc
            raise
        if limit is not None and clock.monotonic() - started > limit:
            raise TaskTimeout(input["task"], limit, clock.monotonic() - started)
        return value

    def _failed(self, ctx: Any, task: Any, result: Any, input: Any, exc: BaseException) -> Failed:
        """The failed call's answer: retried under the task's policy (``Retry(on=...)``),
        after its ``backoff`` function's delay, or not at all if that says None."""
        message = scrub_error(f"{type(exc).__name__}: {exc}")
        policy = type(self).retry
        if policy is None or not policy.retries_exception(exc):
            return Failed(message, codes.TASK_FAILED, False)
        path = input_option(input, "backoff")
        if path is None or ctx.run_row.consecutive_failures + 1 >= policy.max_attempts:
            return Failed(message, codes.TASK_FAILED, True)  # no backoff to ask, or no retry left
        delay, why = ask_backoff(task, path, exc, result)
        if delay is None:
            return Failed(f"{message} ({why}: not retried)", codes.TASK_FAILED, False)
        return Failed(message, codes.TASK_FAILED, True, delay)


class ReconcilingTaskAction(TaskAction, abstract=True):
    """An external task that declares ``reconcile``: asked, after a crash, a lost lease
    or a cut call left the call's outcome unknown, whether it happened.

    Its answer is the task's own: ``failed(..., retryable=True)`` means "it did not
    happen", and the call is made again as a new attempt (under the same
    ``effect_key``, within its retry bound). So ``redispatch_when_absent``: the
    task's author, who wrote the lookup, vouches that "absent" is safe to act on
    (docs/tasks.md). ``waiting`` is no answer a task gives: it is ``unknown``.
    """

    redispatch_when_absent = True

    def reconcile(self, ctx: Any, input: Any) -> Any:
        run: WorkflowRun = ctx.run_row
        path = input["task"]
        try:
            task = load_task(path)
        except TaskUnavailable as exc:
            return unknown(f"{exc}: its reconcile was not asked")
        check = import_reconcile(input_option(input, "reconcile"))
        result = running_result(task, run, input, attempt_number(ctx, run), timezone.now())
        args = list(input["args"])
        if task.takes_context:
            args.insert(0, base_api.TaskContext(task_result=result))
        token = current_step.set(ctx)
        try:
            answer = check(*args, **input["kwargs"])
            if inspect.iscoroutine(answer):
                answer = hooks.run_coroutine(answer, ctx.abort)
        finally:
            current_step.reset(token)
        if isinstance(answer, Succeeded):
            return succeeded_as_stored(_json_return(answer.output), summary=f"task {path}")
        if isinstance(answer, Failed | Unknown):
            return answer
        return unknown(
            f"reconcile {input_option(input, 'reconcile')} returned {answer!r:.100}: a task's "
            "reconcile returns succeeded(value), failed(message, retryable=...) or unknown(reason)"
        )


def ask_backoff(task: Any, path: str, exc: BaseException, result: Any) -> tuple[int | None, str]:
    """The delay in milliseconds before the next attempt, as the task's ``backoff``
    function says it (``backoff(exception, task_result)``), or None and why not.

    ``path`` is the run input's: the function's dotted path, or ``BACKOFF_ON_TASK``
    (a lambda: the task's own, read from its backend's options on this worker).
    None, a value that is not seconds, or an exception it raises: no retry. A
    backoff that fails is a bug to see, not a reason to retry at some other pace.
    """
    try:
        if path == BACKOFF_ON_TASK:
            backoff = task.get_backend().options_of(task).backoff
        else:
            backoff = import_string(path)
        seconds = backoff(exc, result)
    except Exception as exc:
        logger.exception("task %s: its backoff raised", task.module_path)
        return None, f"its backoff raised {type(exc).__name__}: {exc}"
    if seconds is None:
        return None, "its backoff returned None"
    if isinstance(seconds, dt.timedelta):
        seconds = seconds.total_seconds()
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, int | float)
        or not 0 <= seconds <= MAX_BACKOFF_S
    ):
        logger.error("task %s: its backoff returned %r, not seconds", task.module_path, seconds)
        return None, f"its backoff returned {seconds!r:.80}, not seconds from 0 to a year"
    return int(seconds * 1000), ""


def import_reconcile(path: str) -> Any:
    """The reconcile function at ``path``, on the worker. One that does not import is
    raised: the kernel makes it an unknown outcome, for an operator."""
    try:
        return import_string(path)
    except ImportError as exc:
        raise RuntimeError(f"reconcile {path} does not import on this worker: {exc}") from exc


def _json_return(value: Any) -> Any:
    """The return value as it will read back, or ``TypeError`` as Django's own backends raise."""
    try:
        value = base_api.normalize_json(value) if hasattr(base_api, "normalize_json") else value
        return to_json_value(value, "the task's return value")
    except (InvalidInput, ValueError) as exc:
        raise TypeError(f"the task returned a value that is not JSON: {exc}") from exc


def _record(
    ctx: Any,
    attempt: int,
    worker_id: str,
    started: dt.datetime,
    exc: BaseException,
    cause: BaseException | None,
) -> str:
    """The failed attempt's ``TaskError``, fenced: a worker that lost the run adds nothing.
    Returns the traceback as stored."""
    shown = cause or exc
    text = scrub_error("".join(traceback.format_exception(shown)))
    row = TaskAttempt(
        run_id=ctx.run_id,
        attempt=attempt,
        worker_id=worker_id,
        started_at=started,
        finished_at=timezone.now(),
        exception_class_path=f"{type(shown).__module__}.{type(shown).__qualname__}",
        traceback=text,
    )
    row.seal = seals.seal_of(attempt_text(row))
    with ctx.fenced(ctx.using):
        row.save(using=ctx.using, force_insert=True)
    return text


def attempt_text(row: TaskAttempt) -> str:
    """What an attempt's seal covers: the whole row but its id."""
    return canonical(
        [
            "task_attempt",
            str(row.run_id),
            row.attempt,
            row.worker_id,
            row.started_at.isoformat(),
            row.finished_at.isoformat(),
            row.exception_class_path,
            row.traceback,
        ]
    )


def sealed_attempts(run_id: Any, rows: list[TaskAttempt]) -> list[TaskAttempt]:
    """The attempts the worker wrote, each once: a row the runtime role inserted, edited
    or copied is refused, loudly, and never shown as the task's error."""
    kept, refused = checked_attempts(rows)
    for row, problem in refused:
        logger.error("task run %s: attempt row %s is not used: %s", run_id, row.pk, problem)
    return kept


def checked_attempts(
    rows: list[TaskAttempt],
) -> tuple[list[TaskAttempt], list[tuple[TaskAttempt, str]]]:
    """``rows`` of one run split into the attempts the worker wrote, each once, and the
    rows refused, with why: ``sealed_attempts`` and ``verifyworkflows`` judge alike.

    The seal covers the whole row but its id, so a copy of a genuine row within
    its run (``INSERT ... SELECT`` by the runtime role) verifies: six copies of
    one failed attempt read as six errors and six workers (#47). A copy is the
    same sealed row again, and is counted once. Only the same seal makes a copy,
    not the same attempt number: an operator's retry numbers a task's attempts
    from 1 again, and each of those is a genuine attempt of its own.

    Refused where it is read, not by a unique index on (run, attempt): the runtime
    role may INSERT here, and a junk row of the next attempt's number, inserted
    first, would make the worker's own insert of that attempt fail, so that the
    attempt could never be recorded. What it can write is a row whose seal does
    not verify, or a copy: neither is shown or counted, ``verifyworkflows`` names both.
    """
    kept: list[TaskAttempt] = []
    refused: list[tuple[TaskAttempt, str]] = []
    first: dict[str, TaskAttempt] = {}
    for row in rows:
        problem = seals.text_problem(row.seal, attempt_text(row))
        original = first.get(row.seal) if problem is None else None
        if original is not None:
            problem = (
                f"a copy of attempt {row.attempt}, which row {original.pk} holds already: "
                "counted once"
            )
        if problem is None:
            first[row.seal] = row
            kept.append(row)
        else:
            refused.append((row, problem))
    return kept, refused


def attempt_number(ctx: Any, run: WorkflowRun) -> int:
    """Which call of the task's function this is, the first being 1.

    An external task's attempts are its dispatches (the invocation key counts
    them); a pure or idempotent task's are the failures and crashes in a row
    before this claim, plus this one.
    """
    key = getattr(ctx, "invocation_key", None)
    earlier = _earlier_attempts(ctx, run)
    if key:
        return earlier + int(key.rsplit(":", 1)[1])
    return earlier + run.consecutive_failures + 1


def _earlier_attempts(ctx: Any, run: WorkflowRun) -> int:
    """The calls made at the steps before this one: after an operator retried a failed
    call (``_call``), its attempts go on from there. Step 0 (every call no operator
    retried) asks nothing."""
    if not getattr(ctx, "step", 0):
        return 0
    using = run._state.db or settings.database()
    if getattr(ctx, "invocation_key", None):
        return (
            LedgerEntry.objects.using(using)
            .filter(run_id=run.pk, kind=LedgerEntry.Kind.DISPATCHED, seq__lt=ctx.step)
            .count()
        )
    # Each failed call left a row; this step's own failures are its consecutive ones.
    rows = len(sealed_attempts(run.pk, list(attempts_of(run))))
    return max(rows - run.consecutive_failures, 0)


_actions: dict[tuple[Any, ...], type[TaskAction]] = {}


def action_for(effect: str, input: Any) -> type[TaskAction]:
    """The step's action: named for the task's path, with its effect, retry and rate limit."""
    path = input["task"]
    reconcile = input_option(input, "reconcile") if effect == "external" else None
    timeout = input_option(input, "timeout")
    key = (
        effect,
        path,
        repr(input.get("retry")),
        repr(input.get("rate_limit")),
        reconcile,
        timeout,
    )
    cls = _actions.get(key)
    if cls is None:
        attrs: dict[str, Any] = {
            "name": f"task:{path}",
            "effect": EFFECTS[effect],
            "retry": input_option(input, "retry"),
            # The kernel's step timeout: the lease is renewed up to it, no further.
            "timeout": timeout,
            "task_timeout": timeout,
            "__module__": __name__,
        }
        rate_limit = input_option(input, "rate_limit")
        if rate_limit is not None:
            attrs["rate_limit"] = rate_limit
        base = TaskAction if reconcile is None else ReconcilingTaskAction
        cls = _actions[key] = type(f"Task_{effect}", (base,), attrs)
    return cls


#: Retries an operator granted a task call that failed by raising: ``RETRIED`` entries
#: naming the failed step (``interventions.FAILED_STEP``), written under the run's lock
#: only while the run was FAILED, so a replay always counts as many as its first run did
#: at each failure.
_GRANTED_SQL = f"""
SELECT count(*) FROM k2b_ledger
 WHERE run_id = %s AND kind = 'retried' AND detail ->> '{interventions.FAILED_STEP}' IS NOT NULL
"""


def granted_retries(run_id: Any) -> int:
    with connections[settings.database()].cursor() as cursor:
        cursor.execute(_GRANTED_SQL, [run_id])
        (count,) = cursor.fetchone()
    return int(count)


def _call(run: RunHandle, effect: str, input: Any) -> Any:
    """The task's one step; after an operator's retry of a call that failed, the same
    step again at the next position: one more attempt of the same call (#51).

    A failed call's failure is journaled, so a replay raises it again; each retry
    the operator granted lets the replay go past one such failure. Read only
    after a failure: a call that succeeds costs no query.
    """
    action = action_for(effect, input)
    granted: int | None = None
    failures = 0
    while True:
        try:
            return run.step(action, input)
        except StepFailed:
            if granted is None:
                granted = granted_retries(run.id)
            if failures >= granted:
                raise
            failures += 1


def _pure(run: RunHandle, input: Any) -> Any:
    return _call(run, "pure", input)


def _idempotent(run: RunHandle, input: Any) -> Any:
    return _call(run, "idempotent", input)


def _external(run: RunHandle, input: Any) -> Any:
    return _call(run, "external", input)


def register() -> None:
    """Register the three task workflows (again, after a test cleared the registry)."""
    for effect, fn in (("pure", _pure), ("idempotent", _idempotent), ("external", _external)):
        workflow(WORKFLOW_NAMES[effect], app_id=TASK_APP_ID)(fn)
        starts.INPUT_COLUMNS[WORKFLOW_NAMES[effect]] = run_columns
        uniques.REPLACED_INPUT[WORKFLOW_NAMES[effect]] = replaced_input


register()


# -- TaskResult from a run ----------------------------------------------------------


#: backend alias -> the class of its backend: the sender of a task's signals. Looked
#: up once per alias, not through ``task_backends`` (a thread-local handler) per task.
_backend_classes: dict[str, type] = {}


def backend_class(task: Any) -> type:
    cls = _backend_classes.get(task.backend)
    if cls is None:
        cls = _backend_classes[task.backend] = type(task.get_backend())
    return cls


def _forget_backends(*, setting: str, **kwargs: Any) -> None:
    if setting == "TASKS":
        _backend_classes.clear()


setting_changed.connect(_forget_backends, dispatch_uid="k2b_workflows.taskruns.backends")


def status_of(run: WorkflowRun, attempts: int) -> Any:
    """Django's status of a task run: RUNNING until an operator decides an unknown outcome."""
    status = base_api.TaskResultStatus
    if run.status == RunStatus.SUCCEEDED:
        return status.SUCCESSFUL
    if run.status in (RunStatus.FAILED, RunStatus.CANCELED):
        return status.FAILED
    if run.status in (RunStatus.RUNNING, RunStatus.NEEDS_ATTENTION):
        return status.RUNNING
    # Queued: ready until a first attempt; after one, it is being retried.
    return status.RUNNING if attempts or run.consecutive_failures else status.READY


def new_result(task: Any, run: WorkflowRun | starts.QueuedRun, input: Any, **fields: Any) -> Any:
    values: dict[str, Any] = {
        "task": task,
        "id": str(run.pk),
        "status": base_api.TaskResultStatus.READY,
        "enqueued_at": run.created_at,
        "started_at": None,
        "finished_at": None,
        "last_attempted_at": None,
        "args": input["args"],
        "kwargs": input["kwargs"],
        "backend": input_option(input, "backend"),
        "errors": [],
        "worker_ids": [],
    }
    values.update(fields)
    return base_api.TaskResult(**values)


def running_result(
    task: Any, run: WorkflowRun, input: Any, attempt: int, started: dt.datetime
) -> Any:
    """The result a running task sees (``context.task_result``) and ``task_started`` sends.

    Read from the run's failed attempts only after a first one: a first call
    costs no query.
    """
    rows = sealed_attempts(run.pk, list(attempts_of(run))) if attempt > 1 else []
    worker_ids = attempt_workers(rows, _lost(run), attempt - 1)
    worker_ids.append(run.claimed_by)
    return new_result(
        task,
        run,
        input,
        status=base_api.TaskResultStatus.RUNNING,
        started_at=rows[0].started_at if rows else started,
        last_attempted_at=started,
        errors=[error_of(row) for row in rows],
        worker_ids=worker_ids,
    )


def attempt_workers(rows: list[TaskAttempt], lost: list[str], before: int) -> list[str]:
    """The worker of each of the ``before`` attempts before the current one, in order.

    A failed attempt left a row naming its worker; a crashed one left its worker
    in ``lease_lost_by`` (the reap's record). Attempts without either (a crash
    from before that record existed) are ``""``: their count is known, not their
    worker.
    """
    by_attempt = {row.attempt: row.worker_id for row in rows}
    crashed = iter(lost)
    before = max(before, len(rows) + len(lost))
    ids = [
        by_attempt.pop(n) if n in by_attempt else next(crashed, "") for n in range(1, before + 1)
    ]
    return ids + [by_attempt[n] for n in sorted(by_attempt)]


def dispatch_workers(run: WorkflowRun) -> list[str]:
    """The worker of each call of an external task's function: its dispatches, in order.

    Each call is dispatched before it is made, whether it then failed, crashed,
    was cut, or succeeded; a call made again after an operator's "effect
    absent" or a reconcile's "absent" is one more. So ``TaskResult.attempts``
    counts the calls of the function, not the rows its failures left. A run
    claimed and about to call again (no dispatch of this claim yet) counts its
    worker too.
    """
    rows = list(
        LedgerEntry.objects.using(run._state.db or "default")
        .filter(run_id=run.pk, kind=LedgerEntry.Kind.DISPATCHED)
        .order_by("id")
        .values_list("generation", "detail")
    )
    workers = [str((detail or {}).get("worker") or "") for _, detail in rows]
    mine = any(generation == run.generation for generation, _ in rows)
    if run.status == RunStatus.RUNNING and run.claimed_by and not mine:
        workers.append(run.claimed_by)
    return workers


def _lost(run: WorkflowRun) -> list[str]:
    """The workers whose lease on ``run`` expired while its task ran: attempts of a
    pure or idempotent task (an external one's crash is not run again: its
    attempts are its dispatches, whose failures leave rows)."""
    if EFFECT_OF_WORKFLOW.get(run.workflow_name) == "external":
        return []
    lost = run.lease_lost_by
    return [str(w) for w in lost] if isinstance(lost, list) else []


def attempts_of(run: WorkflowRun) -> Any:
    return TaskAttempt.objects.using(run._state.db or "default").filter(run_id=run.pk)


def error_of(row: TaskAttempt) -> Any:
    return base_api.TaskError(
        exception_class_path=row.exception_class_path, traceback=row.traceback
    )


def result_of(task: Any, run: WorkflowRun, rows: list[TaskAttempt], started: Any) -> Any:
    """The ``TaskResult`` of ``run`` as stored: its failed attempts and, once it
    succeeded or while it runs, the attempt that holds it."""
    input = run.input
    rows = sealed_attempts(run.pk, rows)
    current = run.status in (RunStatus.RUNNING, RunStatus.SUCCEEDED, RunStatus.NEEDS_ATTENTION)
    if EFFECT_OF_WORKFLOW.get(run.workflow_name) == "external":
        worker_ids = dispatch_workers(run)
    else:
        worker_ids = attempt_workers(rows, _lost(run), 0)
        if current and run.claimed_by:
            worker_ids.append(run.claimed_by)
    starts = [row.started_at for row in rows]
    if current and started is not None:
        starts.append(started)
    result = new_result(
        task,
        run,
        input,
        status=status_of(run, len(worker_ids)),
        started_at=min(starts) if starts else None,
        last_attempted_at=max(starts) if starts else None,
        finished_at=run.finished_at if run.status in _FINISHED else None,
        errors=[error_of(row) for row in rows],
        worker_ids=worker_ids,
    )
    if run.status == RunStatus.SUCCEEDED:
        object.__setattr__(result, "_return_value", run.output)
    if run.status == RunStatus.CANCELED:
        # A canceled call's last error says so (#49), after its attempts' own errors.
        result.errors.append(
            base_api.TaskError(
                exception_class_path=f"{RunCanceled.__module__}.{RunCanceled.__qualname__}",
                traceback=f"{RunCanceled.__qualname__}: {run.error_message or 'canceled'}",
            )
        )
    return result


_FINISHED = (RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELED)


def task_at(path: str, input: Any) -> Any:
    """The task a result names: imported, or a stand-in when its module is gone, so that
    a result can still be read (its status, errors) after a task was removed."""
    try:
        return load_task(path)
    except TaskUnavailable:
        stand_in: Any = object.__new__(_stand_in_class())
        values = {
            "func": missing_task_at(path),
            "priority": input_option(input, "priority"),
            "backend": input_option(input, "backend"),
            "queue_name": input_option(input, "queue"),
            "run_after": None,
            "takes_context": False,
        }
        for field, value in values.items():
            object.__setattr__(stand_in, field, value)
        return stand_in


def _stand_in_class() -> type:
    task_class: type = base_api.Task
    return task_class


def missing_task(*args: Any, **kwargs: Any) -> Any:
    """Stands for a task whose module no longer imports here."""
    raise RuntimeError("this task's code is not available in this process")


def missing_task_at(path: str) -> Any:
    """``missing_task`` named as the task enqueued at ``path``: Django names a task
    by its function's module and name (``module_path``, the ``path=`` of its log
    lines), which named this module's stand-in instead of the task (#51)."""

    def stand_in(*args: Any, **kwargs: Any) -> Any:
        return missing_task(*args, **kwargs)

    module, _, name = path.rpartition(".")
    stand_in.__module__, stand_in.__name__, stand_in.__qualname__ = module, name, name
    return stand_in
