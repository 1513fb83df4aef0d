"""Starting, canceling, waking, resolving and retrying runs, pausing queues: what user code calls.

The façade over the kernel: each function checks its arguments (a clear
``InvalidInput`` naming the bad one, before anything is written) and the
actor's permission, then calls the kernel, which alone writes runs, journals
and ledgers (``kernel/starts.py`` builds every new run,
``kernel/interventions.py`` cancels, settles and retries).

Every function joins the caller's transaction when there is one: nothing it
does is visible (or wakes a worker) unless that transaction commits.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

from django.apps import apps
from django.core.exceptions import PermissionDenied
from django.db import transaction

from . import codes, naming, settings, tracing, validation
from .exceptions import InvalidInput, StepFailed, UnknownWorkflow
from .fairness import of_workflow_run
from .kernel import children, db, forks, interventions, pauses, seals, starts, uniques, waits
from .kernel.budgets import BudgetExceeded
from .kernel.context import KernelStepContext
from .kernel.interventions import (
    EFFECT_ABSENT,
    EFFECT_CONFIRMED,
    RESOLUTION_DECISIONS,
    RESOLVABLE_CODES,
    RETRYABLE_INCIDENT_CODES,
    retry_refusal,
)
from .models import QueuePause, WorkflowRun
from .unique import Unique, check_unique, workflow_key_values
from .validation import to_json_value
from .workflows import RunHandle, get_workflow

if TYPE_CHECKING:
    from .dryrun import _DryExecution

__all__ = [
    "EFFECT_ABSENT",
    "EFFECT_CONFIRMED",
    "RESOLUTION_DECISIONS",
    "RESOLVABLE_CODES",
    "RETRYABLE_INCIDENT_CODES",
    "cancel_run",
    "cancel_workflow_run",
    "count_child_workflow_runs",
    "create_child_workflow_runs",
    "fork_workflow_run",
    "notify_workflow_worker",
    "pause_queue",
    "paused_queues",
    "reenqueue_refusal",
    "reenqueue_workflow_run",
    "resolve_effect",
    "resume_queue",
    "retry_refusal",
    "retry_workflow_run",
    "start_workflow_run",
    "wake_workflow_runs_waiting_on",
]


def start_workflow_run(
    name: str,
    input: Any,
    *,
    idempotency_key: str | None = None,
    principal: Any = None,
    parent: WorkflowRun | uuid.UUID | str | None = None,
    version: int | None = None,
    concurrency_key: str | None = None,
    priority: int = 0,
    run_after: Any = None,
    schedule_id: str | None = None,
    scheduled_for: Any = None,
    queue: str | None = None,
    unique: Unique | None = None,
    fairness_key: Any = None,
) -> WorkflowRun:
    """Queue a run of workflow ``name``. The same ``idempotency_key`` returns the same run.

    The run is pinned to ``version`` (default: the newest registered here) for
    its whole life. ``concurrency_key`` (for a workflow declaring
    ``concurrency=Concurrency(...)``) limits the active runs sharing it;
    ``priority`` (0 to 1000, higher first, aged by ``PRIORITY_AGING_MS``) orders
    claims; ``run_after`` (an aware datetime) delays the first claim.
    ``schedule_id`` and ``scheduled_for`` are set by schedule passes
    (``kernel/schedule_passes.py``) and the admin's "run now". ``queue``: the
    queue it is claimed from (default: the workflow's, "default" unless
    ``@workflow(queue=...)`` says otherwise; #49). ``unique``: a ``Unique`` (default:
    the workflow's ``@workflow(unique=...)``): a start whose key a run holds inserts
    nothing and returns that run (``keys`` name fields of the input; #49).
    ``fairness_key``: the key by which the run takes turns with other keys' runs of
    its queue (weighted by the workflow's ``Fairness``, if it declares one), instead
    of the input's field ``@workflow(fairness=Fairness(key=...))`` names (#50).

    Raises ``UnknownWorkflow`` or ``InvalidInput`` before creating anything,
    ``IdempotencyConflict`` when the key names a run started with another input,
    and ``DatabaseNotMigrated`` when the app's tables are missing.
    """
    validation.text(name, "the workflow name", max_length=200)
    validation.integer(version, "version", minimum=1, maximum=validation.MAX_INT, optional=True)
    definition = get_workflow(name, version)
    if input is None:
        raise InvalidInput("the workflow input must not be None (use {} for no input)")
    input = to_json_value(input, "the workflow input")
    principal = to_json_value(principal, "the principal")
    if idempotency_key is not None:
        validation.text(idempotency_key, "idempotency_key", max_length=255)
    parent_id = None if parent is None else validation.run_id(parent, "parent")
    if queue is not None:
        validation.queue_name(queue)
    unique = check_unique(unique, "start_workflow_run()") or definition.unique
    claim = None
    if unique is not None:
        key = unique.key("workflow", definition.name, workflow_key_values(unique, input, name))
        claim = uniques.Claim(unique, key)
    fairness = of_workflow_run(definition.fairness, input, fairness_key, definition.name)
    with db.schema_required():
        return starts.start(
            settings.database(),
            definition,
            input,
            idempotency_key=idempotency_key,
            principal=principal,
            parent_id=parent_id,
            concurrency_key=concurrency_key,
            priority=priority,
            run_after=run_after,
            schedule_id=schedule_id,
            scheduled_for=scheduled_for,
            queue=queue,
            unique=claim,
            fairness=fairness,
        )


def start_task_run(
    name: str, input: Any, *, run_after: Any, unique: uniques.Claim | None = None
) -> WorkflowRun:
    """Queue the run of one django.tasks task call (``k2b_workflows.tasks``, #37).

    ``input`` is the run's input, a JSON object the backend built and checked;
    the run's queue (``runworkflows --queue``), priority, task path and
    concurrency are read from it (``starts.INPUT_COLUMNS``). In the caller's
    transaction. ``unique``: the call's unique key (``kernel/uniques.py``).
    """
    definition = get_workflow(name)
    with db.schema_required():
        return starts.start(
            settings.database(), definition, input, run_after=run_after, unique=unique
        )


def start_workflow_runs(
    name: str, inputs: list[Any], *, run_after: Any = None, checked: bool = False
) -> list[starts.QueuedRun]:
    """Queue one run of workflow ``name`` per input, in one transaction (#37).

    What ``enqueue_many`` of django.tasks is made of: a handful of statements
    for thousands of runs (``kernel/starts.py``, ``start_many``), where a start
    per run costs a round trip each. Every input is validated before anything
    is inserted. No idempotency keys or parents: those need
    ``start_workflow_run``. A task's runs take their queue, priority, task path
    and concurrency from their inputs (``starts.INPUT_COLUMNS``). ``checked``:
    the inputs are ``to_json_value``'s results already (the caller validated
    them), not encoded again. A workflow declaring ``unique`` is started one run at a
    time, in one transaction: each start meets the keys of the runs before it.
    """
    validation.text(name, "the workflow name", max_length=200)
    definition = get_workflow(name)
    values = inputs
    if not checked:
        values = []
        for index, value in enumerate(inputs):
            if value is None:
                raise InvalidInput(f"input {index} must not be None (use {{}} for no input)")
            values.append(to_json_value(value, f"input {index}"))
    unique = definition.unique
    if unique is not None or definition.fairness is not None:
        # Each start meets the keys of those before it (a COPY cannot skip a row), or
        # takes its own input's turns.
        claims = [
            None
            if unique is None
            else uniques.Claim(
                unique, unique.key("workflow", name, workflow_key_values(unique, v, name))
            )
            for v in values
        ]
        using = settings.database()
        with db.schema_required(), transaction.atomic(using=using):
            runs = [
                starts.start(using, definition, v, run_after=run_after, unique=claim)
                for v, claim in zip(values, claims, strict=True)
            ]
        return [starts.QueuedRun(run.pk, run.created_at) for run in runs]
    with db.schema_required():
        return starts.start_many(settings.database(), definition, values, run_after=run_after)


def cancel_workflow_run(run_id: uuid.UUID | str, reason: str) -> WorkflowRun:
    """Cancel a run and its whole subtree of children, with their AI tasks (#49).

    A queued, waiting or parked run (a needs-attention one too) ends canceled at
    once with its subtree. A running run is asked, as ``tasks.cancel`` asks a
    task call: its current step finishes (its result and effect records commit
    under the fence as usual), then no further step starts and the run ends
    canceled at its worker's next step boundary; ``ctx.canceled`` turns true in
    the step within a second. Its running children are asked alike, the others
    end at once. A run that already ended is returned unchanged.
    """
    if not isinstance(reason, str) or not reason.strip():
        raise InvalidInput("cancel_workflow_run() needs a reason")
    validation.long_text(reason, "the cancel reason")
    return interventions.request_cancel(settings.database(), validation.run_id(run_id), reason)


def cancel_run(
    run_id: uuid.UUID, reason: str, *, code: str = codes.CANCELED, overdue: bool = False
) -> WorkflowRun:
    """End a run and its subtree canceled at once, running or not, with ``code``; with
    ``overdue``, only a run whose ``timeout_at`` has passed and that is still queued,
    running or waiting, checked under its lock (the timeout sweep,
    ``worker/timeouts.py``: a timeout is not a request, what a step returns after it
    is discarded)."""
    return interventions.cancel(settings.database(), run_id, reason, code=code, overdue=overdue)


def wake_workflow_runs_waiting_on(*, app_id: str, kind: str, key: str) -> int:
    """Record a wake for ``(app_id, kind, key)`` and re-queue the runs parked on it.

    Durable and safe in any order relative to the waiter parking. Returns the
    number of runs re-queued now (a waiter that parks later finds the signal).
    """
    # The rendezvous row's columns: a longer key would fail inside the wake.
    for value, what, length in ((app_id, "app_id", 100), (kind, "kind", 200), (key, "key", 500)):
        if not isinstance(value, str) or not value:
            raise InvalidInput(f"{what} must be a non-empty string")
        validation.text(value, what, max_length=length)
    woken = waits.wake(settings.database(), app_id=app_id, kind=kind, key=key)
    if tracing.ENABLED:
        tracing.woke(app_id=app_id, kind=kind, woken=woken)
    return woken


def notify_workflow_worker(app_id: str) -> None:
    """Wake idle workers of ``app_id`` now (on commit). Runs are found without it, only later."""
    waits.notify(settings.database(), validation.text(app_id, "app_id", max_length=100))


def create_child_workflow_runs(
    ctx_or_run: KernelStepContext | RunHandle, name: str, inputs: list[Any]
) -> list[WorkflowRun]:
    """Create child runs of the current step without waiting for them (idempotently)."""
    if isinstance(ctx_or_run, KernelStepContext) and ctx_or_run.dry_run:
        # A dry run executes the children dry and returns unsaved runs: nothing a worker sees.
        dry = cast("_DryExecution", ctx_or_run._execution)
        return dry.planned_children(ctx_or_run.step, name, inputs)
    if isinstance(ctx_or_run, RunHandle):
        ids = ctx_or_run._execution.children(name, inputs, wait=False)
        if getattr(ctx_or_run._execution, "dry_run", False):
            return ids
    elif isinstance(ctx_or_run, KernelStepContext):
        ctx = ctx_or_run
        validation.text(name, "the child workflow name", max_length=200)
        inputs = validation.child_inputs(inputs, "child inputs")
        # StepFailed fails the calling step with this code, before anything is created.
        if len(inputs) > settings.max_children_per_step():
            raise StepFailed(
                codes.FAN_OUT_EXCEEDED,
                f"{len(inputs)} children asked,"
                f" at most {settings.max_children_per_step()} per step",
            )
        try:
            with ctx.fenced(ctx.using):
                parent = WorkflowRun.objects.using(ctx.using).get(pk=ctx.run_id)
                ids = starts.start_children(
                    ctx.using, parent=parent, step=ctx.step, name=name, inputs=inputs
                )
        except BudgetExceeded as exc:
            raise StepFailed(exc.code, str(exc)) from None
    else:
        raise InvalidInput("create_child_workflow_runs() takes a step's ctx or a workflow's run")
    runs = WorkflowRun.objects.using(settings.database()).in_bulk([str(i) for i in ids])
    return [runs[uuid.UUID(str(i))] for i in ids]


def count_child_workflow_runs(run_id: uuid.UUID | str) -> dict[str, int]:
    """``{"queued": n, "running": n, "succeeded": n, ..., "total": n}`` in one query."""
    return children.count(settings.database(), validation.run_id(run_id))


class _NoOutput:
    """The default of ``resolve_effect``'s ``output``: not passed (None is an output)."""

    def __repr__(self) -> str:
        return "<no output given>"


_NO_OUTPUT: Any = _NoOutput()


def resolve_effect(
    run_id: uuid.UUID | str,
    decision: str,
    *,
    evidence: str,
    actor: Any,
    output: Any = _NO_OUTPUT,
    step: int | None = None,
    seen_ledger_id: int | None = None,
) -> WorkflowRun:
    """An operator's decision on an effect whose outcome the kernel cannot know.

    ``EFFECT_CONFIRMED`` journals ``output`` as the step's result without calling
    the provider, and needs it passed: a confirmation without one raises
    ``InvalidInput`` and writes nothing, as the admin and ``workflowrun resolve``
    refuse it. Pass ``output=None`` for an action whose result is ``None``;
    a default would journal None, which the code after the step may not expect.
    ``EFFECT_ABSENT`` re-queues the run so the step runs again under a new
    invocation key and the same ``effect_key``. Both append a
    ledger entry naming the operator with the evidence text.

    ``step`` and ``seen_ledger_id`` (the newest ledger entry the operator was
    shown) are compared under the run lock: a decision about another step, or
    taken before a late result, a reconcile answer or another operator's
    decision arrived, raises ``ResolutionRefused`` (``EvidenceChanged``) and
    changes nothing. The admin always passes both; code calling this directly
    should too.
    """
    if decision not in RESOLUTION_DECISIONS:
        raise InvalidInput(f"decision must be EFFECT_CONFIRMED or EFFECT_ABSENT, not {decision!r}")
    if not isinstance(evidence, str) or not evidence.strip():
        raise InvalidInput("a resolution needs evidence text")
    validation.long_text(evidence, "the evidence")
    run_id = validation.run_id(run_id)
    if (
        actor is None
        or not getattr(actor, "is_active", False)
        or not actor.has_perm("k2b_workflows.resolve_effect")
    ):
        raise PermissionDenied(
            "resolving an effect needs the permission k2b_workflows.resolve_effect"
        )
    if decision == EFFECT_CONFIRMED:
        if output is _NO_OUTPUT:
            raise InvalidInput(
                "EFFECT_CONFIRMED needs output=: the step's result, as the action would have"
                " returned it (output=None if it returns none)"
            )
        output = to_json_value(output, "the confirmed output")
    elif output is _NO_OUTPUT:
        output = None
    for name, value in (("step", step), ("seen_ledger_id", seen_ledger_id)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise InvalidInput(f"{name} must be an integer, not {value!r}")
    return interventions.resolve(
        settings.database(),
        run_id,
        decision,
        evidence_text=evidence.strip(),
        actor=actor,
        output=output,
        step=step,
        seen_ledger_id=seen_ledger_id,
    )


def retry_workflow_run(run_id: uuid.UUID | str, *, actor: Any, reason: str = "") -> WorkflowRun:
    """An operator's "retry now": a run that exhausted its retries, or a code incident.

    Code incidents (``RETRYABLE_INCIDENT_CODES``) are retried once a fix or a
    patch is deployed: the run replays its journal on the code now running.
    A run that failed on a journaled step failure would replay to the same
    failure, so it is refused.
    """
    if actor is None or not actor.has_perm("k2b_workflows.retry_workflowrun"):
        raise PermissionDenied(
            "retrying a run needs the permission k2b_workflows.retry_workflowrun"
        )
    run_id = validation.run_id(run_id)
    if not isinstance(reason, str):
        raise InvalidInput("the retry reason must be a string")
    reason = validation.storable_message(reason)
    return interventions.retry(settings.database(), run_id, actor=actor, reason=reason)


def reenqueue_refusal(run: WorkflowRun) -> str | None:
    """Why ``reenqueue_workflow_run`` refuses ``run``, or None."""
    if run.parent_id is not None:
        return "a child run is started by its parent: re-enqueue its root"
    problem = seals.start_problem(run)
    if problem is not None:
        # Not laundered into a new run with a fresh seal by an operator's click.
        return f"its input is not the one it was started with: {problem}"
    try:
        get_workflow(run.workflow_name)
    except UnknownWorkflow:
        return f"no workflow {run.workflow_name!r} is registered in this process"
    return None


def reenqueue_workflow_run(run_id: uuid.UUID | str, *, actor: Any) -> WorkflowRun:
    """An operator's "re-enqueue": a new run with the same input, beside ``run_id`` (#49).

    For a task call, a new call of the same task with the same arguments and the
    options it was enqueued with (its run's input holds both); for a workflow
    run, a new run of its workflow's newest version, on the same queue, with
    the same priority, concurrency key and principal. The original is not
    touched, whatever its state. Refused (``InvalidInput``, saying why) for a
    child run, and for a run whose start seal does not verify: the runtime role
    can write a run's input, and a re-enqueue would seal what it wrote. Needs
    ``k2b_workflows.retry_workflowrun``, as running a failed run again does.
    """
    if actor is None or not actor.has_perm("k2b_workflows.retry_workflowrun"):
        raise PermissionDenied(
            "re-enqueueing a run needs the permission k2b_workflows.retry_workflowrun"
        )
    run_id = validation.run_id(run_id)
    try:
        run = WorkflowRun.objects.using(settings.database()).get(pk=run_id)
    except WorkflowRun.DoesNotExist:
        raise InvalidInput(f"no workflow run {run_id}") from None
    why = reenqueue_refusal(run)
    if why is not None:
        raise InvalidInput(f"run {run_id} cannot be re-enqueued: {why}")
    if naming.is_task_workflow(run.workflow_name):
        return start_task_run(run.workflow_name, run.input, run_after=None)
    return start_workflow_run(
        run.workflow_name,
        run.input,
        principal=run.principal,
        concurrency_key=run.concurrency_key,
        priority=run.priority,
        queue=run.queue,
    )


#: What an operator needs to fork a run, when the actor is a Django user.
FORK_PERMISSION = "k2b_workflows.fork_workflowrun"


def fork_workflow_run(
    run_id: uuid.UUID | str,
    *,
    from_step: int | str,
    actor: Any,
    reason: str,
    repeat_effects: Iterable[int] = (),
    version: int | None = None,
) -> WorkflowRun:
    """A new run that keeps ``run_id``'s journal before ``from_step`` and runs on from there.

    ``from_step``: a step's ``seq`` in the run's journal (or the step a run that
    did not succeed stopped at), or ``"failure"``: the step at which a failed
    run failed. The steps before it replay their recorded results, failures
    included, children steps with their recorded children (none created
    again); the rest run on today's code (the newest version registered here,
    or ``version``). The new run's ``forked_from`` is ``run_id``; the
    original's ``forks`` lists it. A fork of a task call is a new call with the
    same arguments.

    Only a run that ended (succeeded, failed, canceled) is forked: one that
    may still act would act beside its fork. Raises ``ForkRefused``, listing
    the steps, when a step at or after ``from_step`` dispatched an EXTERNAL,
    IRREVERSIBLE or SNAPSHOT_RESTORE effect (or a child run of a children step
    did), unless ``repeat_effects`` names them; then they run again and the
    fork's ledger records ``actor`` and ``reason``. IDEMPOTENT steps run again
    with the original's effect keys, unless named in ``repeat_effects`` (then
    with new ones). ``actor``: a Django user holding
    ``k2b_workflows.fork_workflowrun``, or a non-empty name (code's own fork).
    Raises ``InvalidInput`` for bad arguments and ``WorkflowRun.DoesNotExist``
    for an unknown run, before anything is written.
    """
    run_id = validation.run_id(run_id)
    if not isinstance(reason, str) or not reason.strip():
        raise InvalidInput("fork_workflow_run() needs a reason: why the run goes on from a step")
    reason = validation.long_text(reason.strip(), "the fork reason")
    if isinstance(repeat_effects, (str, bytes)) or not isinstance(repeat_effects, Iterable):
        raise InvalidInput(f"repeat_effects must be a list of steps, not {repeat_effects!r}")
    repeat = list(repeat_effects)
    validation.integer(version, "version", minimum=1, maximum=validation.MAX_INT, optional=True)
    if isinstance(actor, str):
        if not actor.strip():
            raise InvalidInput("fork_workflow_run() needs an actor: who forks the run")
        name, actor_id = validation.text(actor.strip(), "actor", max_length=150), None
    elif actor is None:
        raise InvalidInput("fork_workflow_run() needs an actor: who forks the run")
    elif not getattr(actor, "is_active", False) or not actor.has_perm(FORK_PERMISSION):
        raise PermissionDenied(f"forking a run needs the permission {FORK_PERMISSION}")
    else:
        name, actor_id = str(actor.get_username()), actor.pk
    using = settings.database()
    with db.schema_required():
        return forks.fork(
            using,
            run_id,
            from_step=from_step,
            actor=name,
            actor_id=actor_id,
            reason=reason,
            repeat_effects=repeat,
            version=version,
        )


def fork_plan(run_id: uuid.UUID | str, from_step: int | str) -> forks.Plan:
    """What ``fork_workflow_run(run_id, from_step=...)`` would repeat, read without writing:
    what the admin shows an operator before they fork. Raises as the fork does."""
    with db.schema_required():
        return forks.plan(settings.database(), validation.run_id(run_id), from_step)


def retry_words(run: WorkflowRun) -> str:
    """What a retry did to ``run``, in the words the admin and ``workflowrun retry`` both say."""
    if run.task_path:
        return (
            f"Task call {run.pk} ({run.task_path}) is {run.status}: one more attempt of the "
            "same call, its attempts counted on."
        )
    return (
        f"Run {run.pk} ({run.workflow_name}) is {run.status}: it replays its journal on the "
        "code running now."
    )


#: What an operator needs to pause or resume a queue, when the actor is a Django user.
PAUSE_PERMISSION = "k2b_workflows.pause_queue"


def pause_queue(name: str, *, reason: str, actor: Any = None) -> bool:
    """Stop every worker claiming queue ``name``'s runs until ``resume_queue(name)`` (#49).

    The pause is a row: it holds for every worker, of every release, across
    restarts and deploys. Runs already claimed finish; enqueues, starts and
    schedule ticks into the queue are accepted and wait, queued. A queue may be
    paused before its first run. ``reason`` (required) is shown with the pause
    to whoever finds the queue paused.

    ``actor``: the Django user pausing it (who needs ``k2b_workflows.pause_queue``;
    the pause then enters the admin's history), a text naming who or what
    pauses it (a deploy script), or None. Returns False when the queue was
    paused already: the first pause, its reason and actor, are kept.
    """
    validation.queue_name(name)
    if not isinstance(reason, str) or not reason.strip():
        raise InvalidInput(
            f"pausing queue {name!r} needs a reason: why it stops, for whoever finds it paused"
        )
    validation.long_text(reason, "the reason")
    paused_by = _queue_actor(actor, "pausing")
    using = settings.database()
    with db.schema_required(), transaction.atomic(using=using):
        row = pauses.pause(using, name, reason=reason.strip(), paused_by=paused_by)
        if row is not None:
            _audit(actor, row, f"Paused: {row.reason}")
    return row is not None


def resume_queue(name: str, *, actor: Any = None) -> bool:
    """Let workers claim queue ``name``'s runs again, at once: every worker is woken (#49).

    Returns False, and changes nothing, when the queue is not paused: a resume
    only promises that the queue is not paused afterwards, so a deploy script
    may resume its queues whether or not an earlier step paused them. A name
    that is not a valid queue name raises ``InvalidInput``. ``actor`` as for
    ``pause_queue``.
    """
    validation.queue_name(name)
    resumed_by = _queue_actor(actor, "resuming")
    using = settings.database()
    with db.schema_required(), transaction.atomic(using=using):
        row = pauses.resume(using, name, resumed_by=resumed_by)
        if row is not None:
            _audit(actor, row, "Resumed")
    return row is not None


def paused_queues() -> dict[str, QueuePause]:
    """The paused queues by name, each with its ``reason``, ``paused_by`` and ``paused_at``."""
    with db.schema_required():
        return pauses.paused(settings.database())


def _queue_actor(actor: Any, doing: str) -> str:
    """Who pauses or resumes, as the pause's row names them; a user must hold the permission."""
    if actor is None:
        return ""
    if isinstance(actor, str):
        return validation.text(actor, "actor", max_length=150)
    if not getattr(actor, "is_active", False) or not actor.has_perm(PAUSE_PERMISSION):
        raise PermissionDenied(f"{doing} a queue needs the permission {PAUSE_PERMISSION}")
    return str(actor.get_username())


def _audit(actor: Any, row: QueuePause, message: str) -> None:
    """A Django user's pause or resume enters the admin's history of the queue, in its
    transaction (what the Schedules page writes for a schedule's pause and resume)."""
    if actor is None or isinstance(actor, str) or not apps.is_installed("django.contrib.admin"):
        return
    from django.contrib.admin.models import CHANGE, LogEntry

    LogEntry.objects.log_actions(
        user_id=actor.pk,
        queryset=[row],
        action_flag=CHANGE,
        change_message=message,
        single_object=True,
    )
