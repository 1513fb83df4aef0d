"""``@workflow``, the registry, and the handle workflow code receives as ``run``.

Replay is deterministic: the n-th ``run.step`` call is step n. A journaled
step returns its stored output without calling the action; a different
action (or input) at a journaled position is a ``WORKFLOW_NONDETERMINISTIC``
incident, never a silent run. Workflow code must do no I/O outside steps.

The registry is keyed by (name, version): a run is pinned to the version it
started with, so a deploy that changes a workflow registers the new version
beside the old one until the old one's runs have drained. Replaying a run on
another version's code is exactly the silent divergence replay must not have.
"""

from __future__ import annotations

import datetime as dt
import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from . import validation
from .exceptions import InvalidInput, UnknownWorkflow
from .fairness import Fairness, check_fairness
from .limits import Concurrency, check_concurrency
from .retries import Retry, check_policy
from .schedules import Schedule
from .unique import Unique, check_unique

WorkflowFn = Callable[["RunHandle", Any], Any]

DEFAULT_MAX_STEPS = 1000
#: The longest workflow ``timeout``: a century, far inside a datetime's range.
MAX_TIMEOUT = dt.timedelta(days=36_525)


@dataclass(frozen=True)
class WorkflowDefinition:
    name: str
    fn: WorkflowFn
    app_id: str
    version: int = 1
    effect_budget: dict[str, int] = field(default_factory=dict)
    max_ai_calls: int | None = None
    max_steps: int = DEFAULT_MAX_STEPS
    #: How its steps are retried where their action has no policy (None: the settings).
    retry: Retry | None = None
    #: A run not ended this long after its start is canceled (``WORKFLOW_TIMEOUT``).
    timeout: dt.timedelta | None = None

    def timeout_at(self, started: dt.datetime) -> dt.datetime | None:
        return None if self.timeout is None else started + self.timeout

    #: At most ``concurrency.limit`` active runs per ``concurrency_key`` (None: no keys).
    concurrency: Concurrency | None = None
    #: Written by ``migrate`` as the ``WorkflowSchedule`` whose id is the name.
    schedule: Schedule | None = None
    #: The queue its runs are claimed from, unless a start names another: what
    #: ``runworkflows --queue`` selects and ``pause_queue`` pauses (#49).
    queue: str = "default"
    #: One run per key of its starts (``Unique``), unless a start gives its own.
    unique: Unique | None = None
    #: Its runs take turns with other keys' in their queue (``Fairness``): the key
    #: is the input's field it names, unless a start gives ``fairness_key``.
    fairness: Fairness | None = None


@dataclass
class ChildResult:
    """One child's outcome as ``run.children`` returns it."""

    status: str
    output: Any
    error_code: str
    run_id: str = ""


class Engine(Protocol):
    """What a ``RunHandle`` drives: the kernel's execution of a run, or a dry run.

    Definitions depend on this, not on the kernel: the kernel imports the
    definitions, never the other way round.
    """

    run_id: Any
    app_id: str
    principal: Any

    def step(
        self,
        action: Any,
        input: Any,
        *,
        approval_ref: str | None = None,
        backup_ref: str | None = None,
    ) -> Any: ...

    def children(self, name: str, inputs: list[Any], *, wait: bool = True) -> Any: ...

    def patched(self, patch_id: str) -> bool: ...

    def deprecate_patch(self, patch_id: str) -> None: ...

    def sleep(self, duration: Any = None, until: Any = None) -> None: ...


#: name -> version -> definition.
_registry: dict[str, dict[int, WorkflowDefinition]] = {}


def workflow(
    name: str,
    *,
    app_id: str = "default",
    version: int = 1,
    effect_budget: dict[str, int] | None = None,
    max_ai_calls: int | None = None,
    max_steps: int = DEFAULT_MAX_STEPS,
    retry: Retry | None = None,
    timeout: dt.timedelta | None = None,
    concurrency: Concurrency | None = None,
    schedule: Schedule | None = None,
    queue: str = "default",
    unique: Unique | None = None,
    fairness: Fairness | None = None,
) -> Callable[[WorkflowFn], WorkflowFn]:
    """Register ``fn(run, input)`` as the workflow ``name``.

    ``effect_budget`` and ``max_ai_calls`` bound the whole tree of runs started
    from a root of this workflow; ``max_steps`` bounds each run's steps and the
    number of children the tree may create. ``retry`` (a ``Retry``) replaces
    the settings' bound and backoff for its steps whose action has no policy.
    ``timeout`` (a positive ``timedelta``): a run not ended that long after its
    start is canceled with ``WORKFLOW_TIMEOUT`` (``worker/timeouts.py``). ``concurrency``
    bounds the active runs started with the same ``concurrency_key`` (see
    docs/flow-control.md). ``schedule`` starts runs by itself
    (a ``Schedule``): ``migrate`` writes it as the schedule whose id is ``name``.
    ``queue``: the queue its runs (its children and its schedule's ticks too) are
    claimed from, unless ``start_workflow_run(queue=...)`` names another
    (``runworkflows --queue``, ``pause_queue``). ``unique``: a ``Unique``, one run
    per key of its starts (``keys`` name fields of the input), unless
    ``start_workflow_run(unique=...)`` gives another. ``fairness``: a ``Fairness``,
    its runs (children and ticks too) take turns in their queue by the input's
    field ``key`` names, unless ``start_workflow_run(fairness_key=...)`` gives the
    key (docs/flow-control.md, "Fair shares").
    """
    if not isinstance(name, str) or not name:
        raise InvalidInput("workflow() takes a non-empty name")
    validation.text(name, "the workflow name", max_length=200)
    validation.text(app_id, "app_id", max_length=100)
    validation.queue_name(queue, f"workflow {name!r}: queue")
    budget = check_effect_budget(effect_budget)
    validation.integer(max_ai_calls, "max_ai_calls", maximum=validation.MAX_INT, optional=True)
    validation.integer(max_steps, "max_steps", minimum=1, maximum=validation.MAX_INT)
    validation.integer(version, "version", minimum=1, maximum=validation.MAX_INT)
    if schedule is not None and not isinstance(schedule, Schedule):
        raise InvalidInput(
            f"workflow {name!r}: schedule must be a Schedule(...), not {type(schedule).__name__}"
        )
    check_policy(retry, "retry")
    if timeout is not None:
        if not isinstance(timeout, dt.timedelta):
            raise InvalidInput(f"timeout must be a timedelta or None, not {timeout!r:.80}")
        if timeout <= dt.timedelta(0):
            raise InvalidInput(f"timeout must be a positive timedelta, not {timeout}")
        if timeout > MAX_TIMEOUT:
            # Accepted, 999,999,999 days raised OverflowError at every start (#35).
            raise InvalidInput(f"timeout must be at most {MAX_TIMEOUT.days} days, not {timeout}")
    check_concurrency(concurrency)
    check_unique(unique, f"workflow {name!r}")
    check_fairness(fairness, f"workflow {name!r}")

    def register(fn: WorkflowFn) -> WorkflowFn:
        if len(inspect.signature(fn).parameters) != 2:
            raise InvalidInput(f"workflow {name!r} must take (run, input)")
        existing = _registry.get(name, {}).get(version)
        if existing is not None and (existing.fn.__module__, existing.fn.__qualname__) != (
            fn.__module__,
            fn.__qualname__,
        ):
            # The latest wins (module reloads, tests that define a workflow per test);
            # two modules claiming one name in production is a bug worth a warning.
            warnings.warn(
                f"workflow {name!r} version {version}: {fn.__module__}.{fn.__qualname__} replaces "
                f"{existing.fn.__module__}.{existing.fn.__qualname__}",
                RuntimeWarning,
                stacklevel=2,
            )
        _registry.setdefault(name, {})[version] = WorkflowDefinition(
            name=name,
            fn=fn,
            app_id=app_id,
            version=version,
            effect_budget=budget,
            max_ai_calls=max_ai_calls,
            max_steps=max_steps,
            retry=retry,
            timeout=timeout,
            concurrency=concurrency,
            schedule=schedule,
            queue=queue,
            unique=unique,
            fairness=fairness,
        )
        fn.workflow_name = name  # type: ignore[attr-defined]
        return fn

    return register


def check_effect_budget(effect_budget: Any, where: str = "") -> dict[str, int]:
    """``effect_budget`` as the budget account stores it: unit -> non-negative int.

    One check for a workflow's budget and a django.tasks task's (``tasks.py``),
    so that a budget one accepts the other does not refuse. ``where`` prefixes
    the error (which task, which ``OPTIONS``).
    """
    prefix = f"{where}: " if where else ""
    if effect_budget is not None and not isinstance(effect_budget, dict):
        raise InvalidInput(f"{prefix}effect_budget must be a dict of unit name -> non-negative int")
    budget = dict(effect_budget or {})
    for unit, amount in budget.items():
        # The units are the charges' column (100 characters); True is an int to Python.
        validation.text(unit, f"{prefix}an effect_budget unit", max_length=100)
        validation.integer(amount, f"{prefix}effect_budget[{unit!r}]", maximum=validation.MAX_INT)
    return budget


def get_workflow(name: str, version: int | None = None) -> WorkflowDefinition:
    """The definition of ``name`` at ``version``, or its newest registered version."""
    # An unhashable name (start_workflow_run(["x"], ...)) is unknown, not a TypeError.
    versions = _registry.get(name) if isinstance(name, str) else None
    if not versions:
        known = ", ".join(sorted(_registry)) or "none"
        raise UnknownWorkflow(f"no workflow named {name!r:.200} is registered (known: {known})")
    if version is None:
        return versions[max(versions)]
    try:
        return versions[version]
    except KeyError:
        known = ", ".join(str(v) for v in sorted(versions))
        raise UnknownWorkflow(
            f"workflow {name!r} has no version {version!r} registered (known: {known})"
        ) from None


def registered_workflows() -> dict[str, WorkflowDefinition]:
    """Each registered name with its newest version: what new runs start on."""
    return {name: versions[max(versions)] for name, versions in _registry.items() if versions}


def registered_versions() -> list[WorkflowDefinition]:
    """Every registered (name, version): what this process can run, old runs included."""
    return [d for versions in _registry.values() for _, d in sorted(versions.items())]


class RunHandle:
    """What workflow code gets as ``run``: identity, ``step`` and ``children``."""

    def __init__(self, execution: Engine) -> None:
        self._execution = execution

    @property
    def id(self) -> Any:
        return self._execution.run_id

    @property
    def app_id(self) -> str:
        return self._execution.app_id

    @property
    def principal(self) -> Any:
        return self._execution.principal

    def step(
        self,
        action: Any,
        input: Any = None,
        *,
        approval_ref: str | None = None,
        backup_ref: str | None = None,
    ) -> Any:
        """Run ``action`` with ``input`` as the next step and return its output.

        Raises ``StepFailed`` when the step fails for good (the workflow may catch it).
        """
        return self._execution.step(action, input, approval_ref=approval_ref, backup_ref=backup_ref)

    def children(self, name: str, inputs: list[Any]) -> list[ChildResult]:
        """Start one child run of ``name`` per input and wait until all have ended.

        Returns one result per input, in order, with ``status``, ``output`` and ``error_code``.
        """
        return self._execution.children(name, inputs)

    def patched(self, patch_id: str) -> bool:
        """Whether this run takes the new branch of the code change ``patch_id``.

        True where the run reaches this point under the new code (the answer is
        journaled as a marker, so replays agree); False where its journal shows
        it passed this point before the patch existed.
        """
        return self._execution.patched(patch_id)

    def deprecate_patch(self, patch_id: str) -> None:
        """Keep replaying runs that journaled ``patch_id`` once the old branch is removed.

        Consumes the marker where a run has one and journals nothing where it has
        none. Remove the call once no run that took the patch is left.
        """
        self._execution.deprecate_patch(patch_id)

    def sleep(self, duration: dt.timedelta) -> None:
        """Pause the run for ``duration`` (a positive ``timedelta``), durably.

        The run parks with no worker thread held and is picked up again when
        the time has passed, on any worker; the timer is a journaled step, so
        a replay after it does not sleep again, and a crash during it changes
        nothing (``kernel/timers.py``).
        """
        self._execution.sleep(duration=duration)

    def sleep_until(self, when: dt.datetime) -> None:
        """Pause the run until ``when`` (an aware ``datetime``), durably, as ``sleep``.

        An instant already passed journals the step and returns at once.
        """
        self._execution.sleep(until=when)
