"""django.tasks on k2b_workflows: the backend ``k2b_workflows.tasks.WorkflowsBackend``.

The failure this is built around: a task enqueued by a request whose
transaction then rolls back (the order was never saved, the mail is sent
anyway), or a task a worker picks up before the row it needs is committed.
``enqueue()`` inserts the task's run on the caller's connection, in the
caller's transaction, on the app's database: a rolled-back enqueue leaves
nothing, and no worker sees a task before its transaction commits.

A task call is a run (``TaskResult.id == str(run.pk)``) of one of the
workflows of ``runs``, chosen by the task's ``effect``: what a crash
does to it is what the kernel does to a step of that class. Priorities,
delays, queues, retries, rate limits, schedules and budgets are the kernel's own.

A task's ``effect_budget`` and ``cost`` guard one call: "this task never
charges more than X, whatever its arguments say". Its run is its own root, so
the budget is written with the run (its input, sealed, and its budget account,
which the runtime role cannot raise), and the worker charges the call's cost
in the kernel's budget path before the function is called. The enqueue checks
the same cost first, so that a call over budget is refused in the caller's
face; the worker's charge is the guarantee.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import inspect
import logging
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import transaction
from django.utils import timezone
from django.utils.module_loading import import_string

from .. import control, scheduling, signals, validation
from .. import settings as k2b_settings
from ..actions import to_json_value
from ..exceptions import InvalidInput, RunEndNotSealed
from ..fairness import Fairness
from ..fairness import key_text as fairness_key_text
from ..kernel import seals, uniques
from ..limits import Concurrency, RateLimit
from ..models import TERMINAL_STATUSES, JournalEntry, TaskAttempt, WorkflowRun, WorkflowSchedule
from ..retries import Retry
from ..schedules import Schedule
from ..unique import Unique
from .compat import (
    InvalidTask,
    TaskResultDoesNotExist,
    backends_api,
    base_api,
    signals_api,
    tasks_api,
)
from .exceptions import InvalidTaskArguments, InvalidTaskCall, TaskRunNotSealed
from .exceptions import TaskTimeout as TaskTimeout
from .names import EFFECT_OF_WORKFLOW, MAX_PATH
from .options import (
    TaskOptions,
    TaskOverride,
    call_cost,
    check_priority,
    check_within,
    function_path,
    task_path,
)
from .runs import current_step, finished_result, new_result, result_of, task_at

#: How far ahead a task's ``run_after`` may be (a datetime, or a timedelta from now):
#: ten years. Further is a mistake, never a plan (a year 9999, milliseconds taken for
#: seconds): it would sit queued for ever, and a bug that made it would go unseen (#47).
MAX_RUN_AFTER = dt.timedelta(days=3653)
#: How many tasks a backend keeps the options of (``options_of``).
MAX_REMEMBERED_TASKS = 1024

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class WorkflowsTask(base_api.Task):
    """Django's ``Task`` with the arguments Django 6.1 passes through ``@task(...)``.

    ``effect``: what a crash while it runs does (``"pure"``, ``"idempotent"``,
    ``"external"``; None: the backend's ``OPTIONS["effect"]``, else external).
    ``retry``: a ``Retry`` for the exceptions it raises (None: never retried).
    ``rate_limit``: a ``RateLimit`` on its calls across every worker.
    ``concurrency``: a ``Concurrency``, at most ``limit`` calls of it active at
    once across every worker (its key is the task's path).
    ``effect_budget``: unit -> non-negative int, what one call may charge.
    ``cost``: what a call charges, a dict of unit -> int or a module-level
    callable taking the call's arguments (as the task does, without its
    context) and returning one. The two go together (None: the backend's
    ``OPTIONS``).
    ``unique``: a ``Unique``, one run per key of its calls (``kernel/uniques.py``):
    a call whose key a run holds inserts nothing and returns that run's result.
    ``fairness``: a ``Fairness``, the parameter whose value is the key by which
    calls of its queue take turns (``fairness.py``), and the keys' weights.
    ``reconcile``: an external task's answer to "did this call happen?", asked
    when a crash, a lost lease or a cut call left it unknown: a module-level
    function (or its dotted path) taking the call's context (if the task takes
    one) and arguments, returning ``succeeded(value)``, ``failed(message,
    retryable=True)`` (it did not happen: call it again), ``failed(...)``
    (FAILED) or ``unknown(reason)`` (an operator decides).

    Django's proposed options (django/new-features #142 and #144), which
    ``using()`` cannot change: ``max_attempts``, how many times a call may run
    in all (1: never retried); ``backoff``, seconds between attempts, or a
    function ``backoff(exception, task_result) -> seconds | None`` (None: no
    more attempts); ``timeout``, seconds a call may run, past which it fails
    with ``TaskTimeout`` (pure, idempotent: retried under its attempts) or its
    outcome is unknown (external). ``retry=Retry(...)`` says the same in one
    declaration: not both.
    """

    effect: str | None = None
    retry: Retry | None = None
    rate_limit: RateLimit | None = None
    concurrency: Concurrency | None = None
    # Out of the hash (a dict has none), as a task without a budget is hashable.
    effect_budget: dict[str, int] | None = dataclasses.field(default=None, hash=False)
    cost: dict[str, int] | Callable[..., dict[str, int]] | None = dataclasses.field(
        default=None, hash=False
    )
    reconcile: Callable[..., Any] | str | None = None
    max_attempts: int | None = None
    backoff: float | Callable[..., Any] | str | None = None
    timeout: float | None = None
    unique: Unique | None = None
    fairness: Fairness | None = None


class WorkflowsBackend(backends_api.BaseTaskBackend):
    """The django.tasks backend whose tasks are durable runs on PostgreSQL."""

    task_class = WorkflowsTask
    supports_defer = True
    supports_async_task = True
    supports_get_result = True
    supports_priority = True

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        _check_queues(alias, params.get("QUEUES"))
        super().__init__(alias, params)
        #: The options of the tasks that declare none (``TaskOptions.defaults``).
        self.defaults = TaskOptions.defaults(alias, self.options)
        #: ``OPTIONS["tasks"]``: the options of tasks one does not own, by path or prefix.
        self.overrides = TaskOverride.all(alias, self.options)
        #: task -> its ``TaskOptions``: read once per task, not once per call.
        self._options: dict[Any, TaskOptions] = {}

    @property
    def default_effect(self) -> str:
        """The effect of this alias's tasks that declare none (``OPTIONS["effect"]``)."""
        effect: str = self.defaults["effect"]
        return effect

    # -- what a task declares ------------------------------------------------------

    def validate_task(self, task: Any) -> None:
        """Every task this backend makes (``@task``, ``using()``) and every enqueue path
        (``enqueue``, ``aenqueue``, ``enqueue_many``, ``schedule_task``) passes here.

        The priority and ``run_after`` are checked before Django's own checks,
        which compare and call them as an int and a datetime: a ``'5'`` raised
        ``TypeError: '<' not supported`` from inside Django, a string
        ``run_after`` an ``AttributeError`` (#47).
        """
        path = task_path(task)
        _check_priority(task.priority, path)
        _check_run_after(task.run_after, path)
        try:
            super().validate_task(_as_if_enqueued_now(task))
        except InvalidTask as exc:
            raise InvalidTaskCall(f"task {path}: {exc}") from None
        if len(path) > MAX_PATH:
            raise InvalidTaskCall(f"task {path}: the module path is over {MAX_PATH} characters")
        self.options_of(task)

    def options_of(self, task: Any) -> TaskOptions:
        """The task's options (``TaskOptions.of``), read on the task's first call and kept:
        a task is a frozen dataclass, equal tasks have equal options."""
        try:
            return self._options[task]
        except KeyError:
            pass
        except TypeError:  # an unhashable task (an option's value is): read each time
            return TaskOptions.of(task, self.alias, self.defaults, self.overrides)
        options = TaskOptions.of(task, self.alias, self.defaults, self.overrides)
        if len(self._options) >= MAX_REMEMBERED_TASKS:
            self._options.clear()  # tasks made by using() per call: start over
        self._options[task] = options
        return options

    def check_cost(self, task: Any, input: Any) -> None:
        """Refuse a call whose cost is over its task's budget, or cannot be computed,
        before anything is inserted: the worker would fail it without calling the
        task. A task's run is its own root, so nothing else was spent from its
        budget: this is the comparison the worker makes. Not a guarantee (a cost
        that reads prices may read others on the worker); the worker's charge is."""
        options = self.options_of(task)
        spec = options.cost
        if not isinstance(spec, str):
            return  # none, or a dict: checked against the budget with the task
        where = f"the call of task {options.path}"
        budget = options.effect_budget
        try:
            cost = call_cost(spec, input["args"], input["kwargs"], budget)
        except InvalidInput as exc:
            raise InvalidTaskCall(f"{where}: {exc}") from exc
        check_within(where, cost, budget)

    # -- enqueue ---------------------------------------------------------------------

    def declared_input(self, task: Any) -> dict[str, Any]:
        """The part of a run's input that is the task's, the same for all its calls."""
        _check_reachable(task)
        return self.options_of(task).to_input()

    def run_input(
        self,
        task: Any,
        args: Sequence[Any],
        kwargs: dict[str, Any] | None,
        bulk: _BulkInputs | None = None,
    ) -> Any:
        """The run's input (``call_input``) and, for a task declaring ``fairness``, the
        key whose turns the call takes and its weight: in the input, so that the call's
        run takes them however it is started (a re-enqueue, a schedule's tick)."""
        input = self.call_input(task, args, kwargs, bulk)
        fairness = self.options_of(task).fairness
        if fairness is not None:
            bound, spread = self.bound_arguments(task, input)
            value = _argument(bound, spread, fairness.key)
            where = f"the call of task {input['task']}: its {fairness.key!r}"
            try:
                key = fairness_key_text(to_json_value(value, where), where)
            except InvalidInput as exc:
                raise InvalidTaskCall(str(exc)) from None
            input["fairness"] = {"key": key, "weight": fairness.weight(key)}
        return input

    def call_input(
        self,
        task: Any,
        args: Sequence[Any],
        kwargs: dict[str, Any] | None,
        bulk: _BulkInputs | None = None,
    ) -> Any:
        """The call and the task's declarations (``declared_input``), validated and as
        they will read back, nothing inserted.

        Every enqueue path turns a call into a run's input here, and only here:
        the call is bound to the task's signature first, so that arguments its
        function does not take are refused at the call rather than on the worker.
        ``bulk``: the task's declarations encoded once, for ``enqueue_many``.
        """
        declared = self.declared_input(task) if bulk is None else bulk.declared
        path = declared["task"]
        if not isinstance(args, list | tuple):
            raise InvalidTaskCall(f"task {path}: args must be a list or tuple, not {args!r:.80}")
        kwargs = {} if kwargs is None else kwargs
        if not isinstance(kwargs, dict):
            raise InvalidTaskCall(f"task {path}: kwargs must be a dict, not {kwargs!r:.80}")
        check_binds(task, path, args, kwargs)
        if bulk is not None:
            encoded = bulk.encoded(args, kwargs)
            if encoded is not None:
                return encoded
        try:
            # One pass over the whole input (enqueue_many makes thousands); on a
            # refusal, the arguments alone, so that the error names which it is.
            return to_json_value(
                {**declared, "args": list(args), "kwargs": kwargs}, f"the call of task {path}"
            )
        except InvalidInput as whole:
            refused = whole
            try:
                to_json_value(list(args), f"the arguments of task {path}")
                to_json_value(kwargs, f"the keyword arguments of task {path}")
            except InvalidInput as exc:
                refused = exc
            raise InvalidTaskCall(str(refused)) from None

    def enqueue(self, task: Any, args: Any, kwargs: Any) -> Any:
        """Insert the task's run in the caller's transaction (one statement)."""
        self.validate_task(task)
        input = self.run_input(task, args, kwargs)
        self.check_cost(task, input)
        return self._start(task, input)

    def _start(self, task: Any, input: Any) -> Any:
        """Start one call's run; its result, ``task_enqueued`` once it commits, unless
        the call's unique key was held: then the holder's result as stored, no signal."""
        options = self.options_of(task)
        claim = self.unique_claim(task, input)
        run = control.start_task_run(
            options.workflow_name, input, run_after=_run_after(task.run_after), unique=claim
        )
        if claim is not None and claim.matched is not None:
            if claim.matched.workflow_name not in EFFECT_OF_WORKFLOW:
                return self.get_result(str(claim.matched.pk))  # not a task's: refused there
            return self.result_of_run(claim.matched)
        result = new_result(task, run, input)
        self._enqueued([result])
        return result

    def unique_claim(self, task: Any, input: Any) -> uniques.Claim | None:
        """The call's unique key, for a task declaring ``unique``: its path and the
        arguments ``keys`` names, bound to the task's signature (``f(7)`` and
        ``f(site_id=7)`` bind alike; defaults are filled in), as JSON."""
        options = self.options_of(task)
        unique = options.unique
        if unique is None:
            return None
        bound, spread = self.bound_arguments(task, input)
        if unique.keys is None:
            values = bound
        else:
            values = {k: _argument(bound, spread, k) for k in unique.keys}
        where = f"the unique key of task {options.path}"
        try:
            values = to_json_value(values, where)
        except InvalidInput as exc:
            raise InvalidTaskCall(str(exc)) from None
        return uniques.Claim(unique, unique.key("task", options.path, values))

    def bound_arguments(self, task: Any, input: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """A call's arguments by parameter name, defaults filled in (``f(7)`` and
        ``f(site_id=7)`` bind alike), and those its ``**kwargs`` took."""
        args, kwargs = input["args"], input["kwargs"]
        signature = _call_signature(task.func, bool(task.takes_context))
        if signature is None:
            return {"args": args, "kwargs": kwargs}, kwargs
        binding = signature.bind(*args, **kwargs)
        binding.apply_defaults()
        bound = dict(binding.arguments)
        spread: dict[str, Any] = next(
            (
                bound.get(p.name, {})
                for p in signature.parameters.values()
                if p.kind is inspect.Parameter.VAR_KEYWORD
            ),
            {},
        )
        return bound, spread

    def _enqueued(self, results: list[Any]) -> None:
        """``task_enqueued`` once the enqueue commits: a rolled-back task was never enqueued."""

        def send() -> None:
            for result in results:
                signals_api.task_enqueued.send(sender=type(self), task_result=result)

        transaction.on_commit(send, using=k2b_settings.database())

    # -- results ---------------------------------------------------------------------

    def get_result(self, result_id: str) -> Any:
        """The task's result from any process; ``TaskResultDoesNotExist`` for an id
        that is malformed or names no task run."""
        try:
            run_id = uuid.UUID(str(result_id))
        except (TypeError, ValueError, AttributeError):
            raise TaskResultDoesNotExist(
                f"{result_id!r:.100} is not a task result id (a run's UUID)"
            ) from None
        using = k2b_settings.database()
        run = (
            WorkflowRun.objects.using(using)
            .filter(pk=run_id, workflow_name__in=list(EFFECT_OF_WORKFLOW))
            .first()
        )
        if run is None:
            raise TaskResultDoesNotExist(f"no task result {result_id}")
        return self.result_of_run(run)

    def result_of_run(self, run: WorkflowRun) -> Any:
        """``get_result`` of a task run read already (a unique call's holder)."""
        using, run_id = k2b_settings.database(), run.pk
        # The runtime role can write a run's input: its task path is imported below
        # (``task_at``), so the seal is checked before it, whatever the run's status
        # (#47). A worker refuses the same row before any step sees it.
        unsealed = seals.start_problem(run)
        if unsealed is not None:
            logger.error("task run %s: its start fields are not used: %s", run_id, unsealed)
            raise TaskRunNotSealed(run_id, unsealed)
        if run.status in TERMINAL_STATUSES:
            # The runtime role can write a queued run's status and output: a caller
            # would read a return value no worker computed (#35). As a waiter does.
            forged = seals.end_problem(run)
            if forged is not None:
                logger.error("task run %s: its end is not used: %s", run_id, forged)
                raise RunEndNotSealed(run_id, forged)
        rows = list(TaskAttempt.objects.using(using).filter(run_id=run_id).order_by("id"))
        return result_of(task_at(run.input["task"], run.input), run, rows, _started(using, run))


# -- helpers users import ------------------------------------------------------------


def effect_key(context: Any) -> str:
    """The stable key of this task call's effect, for the provider's deduplication.

    The same across every attempt, crash and takeover of this call (and an
    operator's "effect absent" retry), different for every other call: pass
    it as the provider's idempotency key.
    """
    result = getattr(context, "task_result", None)
    if result is None:
        raise InvalidInput(
            "effect_key() takes the TaskContext of a task declared with takes_context=True"
        )
    ctx = current_step.get()
    if ctx is not None and str(ctx.run_id) == result.id and not getattr(ctx, "step", 0):
        return str(ctx.effect_key)
    # The call's one key. A step past the first is the same call again, after an
    # operator retried it (#51): its key is the first step's, not its own.
    return f"{result.id}:0"


def enqueue_many(
    task: Any, calls: Iterable[tuple[Sequence[Any], dict[str, Any] | None]]
) -> list[Any]:
    """Enqueue one call of ``task`` per ``(args, kwargs)``, in one transaction.

    A few statements for thousands of calls (``control.start_workflow_runs``);
    each call is validated as ``enqueue()`` does before anything is inserted.
    """
    backend = backend_of(task, "enqueue_many")
    backend.validate_task(task)
    if backend.options_of(task).unique is not None:
        return _enqueue_each(backend, task, calls)
    return start_calls(backend, task, call_inputs(backend, task, calls, "enqueue_many"))


def call_inputs(
    backend: WorkflowsBackend,
    task: Any,
    calls: Iterable[tuple[Sequence[Any], dict[str, Any] | None]],
    caller: str,
) -> list[Any]:
    """The runs' inputs of ``enqueue_many``'s calls, each validated, nothing inserted."""
    backend.validate_task(task)
    if backend.options_of(task).unique is not None:
        # enqueue_many starts such calls one by one (``_enqueue_each``); a batch's
        # members are inserted together, and a matched key has no member to be.
        raise InvalidTaskCall(
            f"{caller}(): task {task.module_path} declares unique=..., which a batch does "
            "not apply: enqueue its calls with enqueue_many, or declare no unique"
        )
    bulk = _BulkInputs(backend, task)
    inputs = []
    for index, call in enumerate(calls):
        if not isinstance(call, list | tuple) or len(call) != 2:
            raise InvalidTaskCall(f"{caller}(): call {index} must be (args, kwargs)")
        input = backend.run_input(task, call[0], call[1], bulk)
        backend.check_cost(task, input)
        inputs.append(input)
    return inputs


def start_calls(backend: WorkflowsBackend, task: Any, inputs: list[Any]) -> list[Any]:
    """Insert the runs of ``inputs`` (``call_inputs``), in one transaction; their results."""
    runs = control.start_workflow_runs(
        backend.options_of(task).workflow_name,
        inputs,
        run_after=_run_after(task.run_after),
        checked=True,
    )
    results = [new_result(task, run, input) for run, input in zip(runs, inputs, strict=True)]
    backend._enqueued(results)
    return results


def _enqueue_each(backend: WorkflowsBackend, task: Any, calls: Iterable[Any]) -> list[Any]:
    """``enqueue_many`` of a task declaring ``unique``: one start per call, in one
    transaction, so that each call meets the keys of the runs before it, in the
    batch and outside it (a ``COPY`` cannot skip a conflicting row). Every call
    is checked before anything is inserted; ``task_enqueued`` once per run
    inserted."""
    bulk = _BulkInputs(backend, task)
    inputs = []
    for index, call in enumerate(calls):
        if not isinstance(call, list | tuple) or len(call) != 2:
            raise InvalidTaskCall(f"enqueue_many(): call {index} must be (args, kwargs)")
        input = backend.run_input(task, call[0], call[1], bulk)
        backend.check_cost(task, input)
        backend.unique_claim(task, input)
        inputs.append(input)
    with transaction.atomic(using=k2b_settings.database()):
        return [backend._start(task, input) for input in inputs]


class _BulkInputs:
    """``run_input`` of many calls of one task, the task's part of the input checked
    and encoded once rather than once a call (#37).

    The input of a call is the task's declarations (``declared_input``) and the
    call's ``args`` and ``kwargs``: as JSON, an object whose members are those
    of the two, so its value is theirs together and its size in bytes the sum
    of theirs less one. A call whose arguments are not plainly a list or tuple
    and a dict, are not JSON, or make the whole too large is encoded by
    ``run_input`` as one ``enqueue()`` is, which refuses it with the same error.
    """

    def __init__(self, backend: WorkflowsBackend, task: Any) -> None:
        self.backend, self.task = backend, task
        self.declared = backend.declared_input(task)
        self.value: dict[str, Any] = {}
        self.room = -1  # every call through run_input, unless the declarations encode
        try:
            validation.check_json(self.declared, "the task's declarations")
            text = validation.CANONICAL_JSON.encode(self.declared)
            self.value = validation.stored_json(text)
        except (InvalidInput, TypeError, ValueError):
            return
        self.room = k2b_settings.max_value_bytes() + 1 - len(text.encode())

    def encoded(self, args: Any, kwargs: Any) -> Any:
        """The input of a call ``run_input`` has checked, or None: encode it one by one."""
        if type(args) in (list, tuple) and type(kwargs) is dict:
            call = {"args": list(args), "kwargs": kwargs}
            try:
                validation.check_json(call, "the call")
                text = validation.CANONICAL_JSON.encode(call)
                fits = len(text.encode()) <= self.room
            except (InvalidInput, TypeError, ValueError):  # UnicodeEncodeError is a ValueError
                fits = False
            if fits:
                return {**self.value, **validation.stored_json(text)}
        return None


def schedule_task(
    schedule_id: str,
    task: Any,
    schedule: Schedule,
    *,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
) -> WorkflowSchedule:
    """A schedule that enqueues ``task(*args, **kwargs)`` once per tick, as
    ``schedule_workflow`` does for a workflow: exactly one run per tick.

    The call's arguments are ``args`` and ``kwargs``; a ``Schedule(input=...)``
    is refused, not dropped (a workflow's schedule takes its input there, a
    task's cannot: its run's input is the call).
    """
    backend = backend_of(task, "schedule_task")
    backend.validate_task(task)
    if not isinstance(schedule, Schedule):
        raise InvalidTaskCall(f"schedule_task() takes a Schedule(...), not {schedule!r:.80}")
    if schedule.input:
        raise InvalidTaskCall(
            f"schedule_task(): a task's schedule takes the call's arguments as args= and "
            f"kwargs= of schedule_task(), not Schedule(input=...): got input={schedule.input!r:.80}"
        )
    input = backend.run_input(task, args, kwargs)
    backend.check_cost(task, input)
    spec = dataclasses.replace(schedule, input=input)
    return scheduling.schedule_workflow(schedule_id, backend.options_of(task).workflow_name, spec)


# -- the end of a task run -----------------------------------------------------------


def _finished(sender: Any, *, run_id: Any, workflow_name: str, status: str, **kwargs: Any) -> None:
    """``task_finished`` once a task run's end has committed (``signals.run_finished``).

    On the worker that ran the last attempt, from what that attempt saw: no
    query on the hot path. Elsewhere (a cancel from a web process), read back.
    """
    if workflow_name not in EFFECT_OF_WORKFLOW:
        return
    seen = finished_result(run_id, status)
    if seen is not None:
        result, sender, error = seen
        _send_finished(sender, result, error)
        return
    run = WorkflowRun.objects.using(k2b_settings.database()).filter(pk=run_id).only("input").first()
    if run is None:
        return
    backend = _backend_named(run.input.get("backend", "default"))
    if backend is None:
        return
    result = backend.get_result(str(run_id))
    signals_api.task_finished.send(sender=type(backend), task_result=result)


def _send_finished(sender: type, result: Any, error: BaseException | None) -> None:
    """``task_finished``, sent while the task's own exception is the one being handled.

    Django logs a failed task with ``logger.exception`` (for error monitoring):
    it reads the exception being handled. The end commits inside the kernel's
    handling of its own ``StepFailed``, so without this the log showed the
    kernel's frames instead of the task's, once per failed task.
    """
    if error is None:
        signals_api.task_finished.send(sender=sender, task_result=result)
        return
    # Raised here only to be the one handled: its traceback and the exception it
    # was raised from (if any) are put back as the task left them, so that neither
    # this frame nor the kernel's exception shows in the log.
    tb, context, suppress = error.__traceback__, error.__context__, error.__suppress_context__
    try:
        raise error
    except BaseException:
        error.__traceback__, error.__context__ = tb, context
        error.__suppress_context__ = suppress
        signals_api.task_finished.send(sender=sender, task_result=result)


signals.run_finished.connect(_finished, dispatch_uid="k2b_workflows.tasks.finished")


# -- private -------------------------------------------------------------------------


@functools.lru_cache(maxsize=1024)
def _reachable(path: str, func: Any) -> bool:
    """Whether ``path`` imports back to the task of ``func``: the worker imports it so."""
    try:
        found = import_string(path)
    except ImportError:
        return False
    return getattr(found, "func", None) is func


def _check_reachable(task: Any) -> None:
    """The task path check: a worker finds a task by its module path; refuse one it
    could not find (defined in ``__main__``, a function renamed after ``@task``)."""
    path = task_path(task)
    if not _reachable(path, task.func):
        raise InvalidTaskCall(
            f"task {path}: that path does not import back to this task, so no worker could "
            "run it: define tasks at module level, as the module's attribute of that name"
        )


def _check_queues(alias: str, queues: Any) -> None:
    """``QUEUES``: a list of queue names. Django makes a set of whatever it is given: a
    string became a set of its letters, and every task on queue "default" was refused
    as not one of them, or a one-letter queue accepted (#47)."""
    if queues is None:
        return
    if isinstance(queues, list | tuple | set | frozenset) and all(
        isinstance(q, str) and q for q in queues
    ):
        return
    raise ImproperlyConfigured(
        f"TASKS[{alias!r}]['QUEUES'] must be a list of queue names (strings), "
        f"not {type(queues).__name__} {queues!r:.80}"
        + (f": write [{queues!r}]" if isinstance(queues, str) else "")
    )


def _check_priority(value: Any, path: str) -> None:
    """Django's -100..100, as an int, as the run's start takes it (``run_columns``):
    Django compares it first and raised a ``TypeError`` of its own for a string."""
    try:
        check_priority(value)
    except InvalidInput as exc:
        raise InvalidTaskCall(f"task {path}: {exc}") from None


def _check_run_after(value: Any, path: str) -> None:
    """``run_after``: None, a datetime, or a ``timedelta`` from now (Celery's countdown),
    at most ``MAX_RUN_AFTER`` ahead.

    A naive datetime is what Django's own backends make of it: refused while
    ``USE_TZ`` is on (it is ambiguous), else the default time zone's local time.
    """
    where = f"task {path}: run_after"
    if value is None:
        return
    if isinstance(value, dt.timedelta):
        if value < dt.timedelta(0):
            raise InvalidTaskCall(f"{where} is a timedelta from now, which must not be negative")
        delay = value
    elif isinstance(value, dt.datetime):
        if timezone.is_naive(value) and settings.USE_TZ:
            raise InvalidTaskCall(
                f"{where} must be an aware datetime while USE_TZ is on, as Django's own "
                f"backends require, not the naive {value.isoformat()}: use "
                "timezone.now() + timedelta(...), or a timedelta from now"
            )
        delay = _when(value) - _now()
    else:
        raise InvalidTaskCall(
            f"{where} must be a datetime or a timedelta from now, "
            f"not {type(value).__name__} {value!r:.80}"
        )
    if delay > MAX_RUN_AFTER:
        raise InvalidTaskCall(
            f"{where} is more than {MAX_RUN_AFTER.days} days (ten years) ahead: {value!r:.80}"
        )


def _as_if_enqueued_now(task: Any) -> Any:
    """``task`` as Django's checks can read it: a ``run_after`` delay made the datetime
    it is from now (Django reads it as a datetime). Copied field by field, without
    calling the class: ``replace()`` and ``copy.copy()`` (Django 6.1's ``Task`` copies
    through ``__reduce__``) make a new task, which Django validates again, here: a
    recursion without end."""
    if not isinstance(task.run_after, dt.timedelta):
        return task
    seen = object.__new__(type(task))
    for field in dataclasses.fields(task):
        object.__setattr__(seen, field.name, getattr(task, field.name))
    object.__setattr__(seen, "run_after", _now() + task.run_after)
    return seen


def _run_after(value: dt.datetime | dt.timedelta | None) -> dt.datetime | None:
    """When the run may start, as the kernel takes it (``validate_task`` checked it)."""
    return None if value is None else _when(value)


def _when(value: dt.datetime | dt.timedelta) -> dt.datetime:
    """A ``run_after`` as an aware datetime: a delay from now, or a naive datetime in
    the default time zone (``USE_TZ`` off: what Django's own backends make of it)."""
    if isinstance(value, dt.timedelta):
        return _now() + value
    return value if timezone.is_aware(value) else timezone.make_aware(value)


def _now() -> dt.datetime:
    """Now, aware whether ``USE_TZ`` is on or off: the kernel takes aware times only."""
    now = timezone.now()
    return now if timezone.is_aware(now) else timezone.make_aware(now)


@functools.lru_cache(maxsize=1024)
def _call_signature(func: Any, takes_context: bool) -> inspect.Signature | None:
    """The signature the caller's arguments bind to: the function's, without the
    context a ``takes_context`` task receives first. None: none Python can read."""
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):
        return None
    if takes_context:
        signature = signature.replace(parameters=list(signature.parameters.values())[1:])
    return signature


def check_binds(task: Any, path: str, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
    """The call binds to the task's function, as Python would bind it on the worker."""
    signature = _call_signature(task.func, bool(task.takes_context))
    if signature is None:
        return
    try:
        signature.bind(*args, **kwargs)
    except TypeError as exc:
        raise InvalidTaskArguments(
            f"task {path}{signature}: {exc} (a worker would fail the call with this TypeError)"
        ) from None


def backend_of(task: Any, caller: str, what: str = "task") -> WorkflowsBackend:
    """The backend of ``task``, a task of a ``WorkflowsBackend``; else an error naming
    ``caller`` and the argument ``what`` was."""
    if not isinstance(task, base_api.Task):
        if isinstance(task, str):
            given = f"the string {task!r:.100}: import the task and pass it"
        elif callable(task):
            given = f"the plain function {function_path(task)}: decorate it with @task"
        else:
            given = f"{type(task).__name__} {task!r:.80}"
        raise InvalidTaskCall(f"{caller}(): {what} must be a task made with @task, not {given}")
    backend = task.get_backend()
    if not isinstance(backend, WorkflowsBackend):
        raise InvalidTaskCall(
            f"{caller}(): {what} {task_path(task)} is on backend {task.backend!r} "
            f"({type(backend).__name__}), not a k2b_workflows.tasks.WorkflowsBackend"
        )
    return backend


def _backend_named(alias: str) -> WorkflowsBackend | None:
    try:
        backend = tasks_api.task_backends[alias]
    except Exception:  # the alias left TASKS since: nobody to tell
        return None
    return backend if isinstance(backend, WorkflowsBackend) else None


def _started(using: str, run: WorkflowRun) -> dt.datetime | None:
    """When the attempt holding the run started: its journal entry's start once it
    succeeded, the claim while it runs."""
    if run.status == "succeeded":
        return (
            JournalEntry.objects.using(using)
            .filter(run_id=run.pk, seq=0)
            .values_list("started_at", flat=True)
            .first()
        )
    if run.status in ("running", "needs_attention"):
        return run.updated_at
    return None


def _argument(bound: dict[str, Any], spread: dict[str, Any], name: str) -> Any:
    """The value of the parameter ``name`` in a bound call (``bound_arguments``): a named
    parameter's, else what its ``**kwargs`` took under that name (None: not given)."""
    return bound[name] if name in bound else spread.get(name)
