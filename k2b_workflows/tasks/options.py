"""Every option of a django.tasks task: read once from the task, written to and read
back from its run's input, each in one place.

The failure this is built around: an option read, defaulted and checked in
several places (the backend's ``OPTIONS``, the task's declaration, the run's
input, the worker's step), which drift apart: a default applied on the
enqueue and not on the worker, a check made on one path and not another.
Before #48 each option stood in six places across three modules.

``TaskOptions.of(task, alias, defaults)`` reads a task's options once (the
backend caches it per task): each declared on the task (``@task(...)``'s
arguments on Django 6.1 and the backport), else the alias's ``OPTIONS``
(``TaskOptions.defaults``: on Django 6.0, where ``@task`` takes no extra
arguments, the only way to declare them), else the option's default.
``to_input()`` writes them into the run's input; ``input_option`` reads
one back on the worker, and ``from_input`` all of them.

How to add an option (``timeout``, say):

1. A field of ``TaskOptions`` whose metadata is ``option(...)``: its check
   (the value as declared and where it was declared, to the value kept, or
   ``InvalidTaskCall``/``InvalidInput`` naming where), its default, and, if the
   worker needs it, its key in the run's input with how it is written
   (``encode``) and read back (``decode``, which checks the input again: a
   schedule or an operator may start a task's run from an input it holds).
2. The argument ``@task(timeout=...)`` takes: a field of the same name on
   ``WorkflowsTask`` (``backend.py``), default None. ``OPTIONS["timeout"]``
   then works too: the known keys of ``OPTIONS`` are these fields.
3. A rule about two options together goes in ``check_together``.

Nothing else defaults or converts a task's options. Two reads stay outside on
purpose: Django's priority is checked (``check_priority``) before Django's own
checks compare it, and the worker reads the task path straight from the
input (``input["task"]``, checked when the run started) where it imports the
task. The run's input of a task is unchanged by an option none of its tasks
declare: keep ``written`` false for a value that means "not declared".
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import inspect
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

from .. import validation
from ..actions import MAX_ACTION_TIMEOUT_S
from ..exceptions import InvalidInput
from ..fairness import Fairness, check_fairness
from ..kernel.budgets import validate_cost
from ..limits import Concurrency, RateLimit, Strategy, check_rate_limit
from ..retries import Retry, check_policy
from ..unique import Unique, check_unique
from ..workflows import check_effect_budget
from .exceptions import InvalidTaskCall
from .names import EFFECT_NAMES, MAX_PATH, PRIORITY_OFFSET, WORKFLOW_NAMES


@dataclasses.dataclass(frozen=True, slots=True)
class Option:
    """How one field of ``TaskOptions`` is declared, checked and kept in a run's input."""

    #: The declared value and where it was declared -> the value kept; raises naming ``where``.
    check: Callable[[Any, str], Any] | None = None
    #: What neither the task nor ``OPTIONS`` declaring it means (passed through ``check``).
    default: Any = None
    #: The run input's key; None: not in the input.
    key: str | None = None
    encode: Callable[[Any], Any] = lambda value: value
    #: The run's input -> the value, checked: what the worker reads.
    decode: Callable[[Mapping[str, Any]], Any] | None = None
    #: Whether the input holds it for these options; None: always.
    written: Callable[[TaskOptions], bool] | None = None


def option(*, optional: bool = False, **kwargs: Any) -> Any:
    """A field of ``TaskOptions`` with its ``Option``. ``optional``: the field is None
    when the options are read back from a run's input that does not hold it as
    declared (it holds what it became: ``max_attempts`` is within ``retry``)."""
    metadata = {"option": Option(**kwargs)}
    if optional:
        return dataclasses.field(default=None, metadata=metadata)
    return dataclasses.field(metadata=metadata)


def task_path(task: Any) -> str:
    """The module path a worker imports the task by."""
    return function_path(getattr(task, "func", None))


def function_path(func: Any) -> str:
    return f"{getattr(func, '__module__', '?')}.{getattr(func, '__qualname__', repr(func))}"


# -- the checks of the declared options ------------------------------------------------


def check_priority(value: Any, field: str = "priority") -> int:
    """Django's -100..100, as an int, as the run's start takes it."""
    priority = validation.integer(value, field, minimum=-PRIORITY_OFFSET, maximum=100)
    assert priority is not None
    return priority


def _effect(value: Any, where: str) -> str:
    if isinstance(value, str) and value in EFFECT_NAMES:
        return value
    allowed = ", ".join(repr(e) for e in EFFECT_NAMES)
    raise InvalidTaskCall(f"{where}: effect must be one of {allowed}, not {value!r:.80}")


def _retry(value: Any, where: str) -> Retry | None:
    policy = check_policy(value, f"{where}: retry")
    if policy is None:
        return None
    if policy.non_retryable_codes:
        raise InvalidTaskCall(
            f"{where}: Retry(non_retryable_codes=...) means nothing for a task: its failures "
            "are exceptions, not error codes"
        )
    if policy.max_attempts == 1:
        raise InvalidTaskCall(
            f"{where}: Retry(max_attempts=1) retries nothing: leave retry out, or allow 2 or more"
        )
    return policy


def _concurrency(value: Any, where: str) -> Concurrency | None:
    if value is None or isinstance(value, Concurrency):
        return value
    raise InvalidTaskCall(f"{where}: concurrency must be a Concurrency(...), not {value!r:.80}")


def _cost_spec(value: Any, where: str) -> dict[str, int] | str | None:
    """A declared cost as the run's input holds it: a dict of unit -> int, or the
    module path of a callable, which must import back to it (the worker computes
    the cost there). A dotted path is taken as one (``OPTIONS`` in settings)."""
    if value is None or isinstance(value, dict):
        if value is not None:
            try:
                checked_cost(value, f"{where}: cost")
            except InvalidInput as exc:
                raise InvalidTaskCall(str(exc)) from None
        return value
    if isinstance(value, str):
        try:
            import_callable(value)
        except InvalidInput as exc:
            raise InvalidTaskCall(f"{where}: {exc}") from None
        return value
    if not callable(value):
        raise InvalidTaskCall(
            f"{where}: cost must be a dict of unit -> int or a module-level function, "
            f"not {value!r:.80}"
        )
    path = f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', '?')}"
    if not _imports_back(path, value):
        raise InvalidTaskCall(
            f"{where}: cost {path} does not import back to that function, so no worker "
            "could compute it: define it at module level"
        )
    return path


def _reconcile(value: Any, where: str) -> str | None:
    """A task's ``reconcile``: a module-level function, kept as its path (the worker
    imports it there), or that path (``OPTIONS``, in settings).

    A path is not imported here: settings name it before its module can be
    imported (it is often the tasks' own module, being imported when the
    backend is made). ``manage.py check`` imports it (``check_task_overrides``);
    one that does not import on a worker is an unknown outcome, for an operator.
    """
    if value is None:
        return None
    if isinstance(value, str):
        if not _DOTTED.fullmatch(value) or len(value) > MAX_PATH:
            raise InvalidTaskCall(
                f"{where}: reconcile {value!r:.100} is not a function's dotted path"
            )
        return value
    if not callable(value):
        raise InvalidTaskCall(
            f"{where}: reconcile must be a module-level function or its dotted path, "
            f"not {value!r:.80}"
        )
    path = function_path(value)
    if not _imports_back(path, value):
        raise InvalidTaskCall(
            f"{where}: reconcile {path} does not import back to that function, so no worker "
            "could call it: define it at module level"
        )
    return path


#: A dotted path of Python identifiers (``module.function``).
_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")


@functools.lru_cache(maxsize=1024)
def _names(path: str, value: Any) -> bool:
    """Whether ``path`` imports back to ``value``."""
    try:
        return import_string(path) is value
    except ImportError:
        return False


def _imports_back(path: str, value: Any) -> bool:
    try:
        return _names(path, value)
    except TypeError:  # an unhashable callable: not cached
        return _names.__wrapped__(path, value)


#: The largest ``max_attempts``: ``Retry``'s own bound.
MAX_ATTEMPTS = 1_000_000
#: The longest constant ``backoff``: a year, as ``Retry.backoff``.
MAX_BACKOFF_S = 366 * 86_400


def _max_attempts(value: Any, where: str) -> int | None:
    """Django's ``max_attempts``: how many times a call may run in all, the first
    included (1: never retried)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_ATTEMPTS:
        raise InvalidTaskCall(
            f"{where}: max_attempts must be an int from 1 to {MAX_ATTEMPTS} (the attempts "
            f"in all, the first included), not {value!r:.80}"
        )
    return value


def _backoff(value: Any, where: str) -> float | str | Callable[..., Any] | None:
    """Django's ``backoff``: seconds between attempts (a number: the same each time), or
    a function ``backoff(exception, task_result) -> seconds | None`` (None: retry no
    more), kept as its dotted path when it imports back, else as itself (a lambda:
    the worker reads it from the task, which it imports anyway)."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise InvalidTaskCall(f"{where}: backoff must be seconds or a function, not {value!r}")
    if isinstance(value, int | float):
        if not 0 <= value <= MAX_BACKOFF_S:
            raise InvalidTaskCall(
                f"{where}: backoff must be seconds from 0 to {MAX_BACKOFF_S} (a year), "
                f"not {value!r}"
            )
        return float(value)
    if isinstance(value, str):
        if not _DOTTED.fullmatch(value) or len(value) > MAX_PATH:
            raise InvalidTaskCall(
                f"{where}: backoff {value!r:.100} is not a function's dotted path"
            )
        return value
    if not callable(value) or inspect.isclass(value):
        raise InvalidTaskCall(
            f"{where}: backoff must be seconds or a function (exception, task_result) -> "
            f"seconds or None, not {value!r:.80}"
        )
    path = function_path(value)
    return path if _imports_back(path, value) else value


def _timeout(value: Any, where: str) -> float | None:
    """Django's ``timeout``: seconds a call may run (the kernel's ``Action.timeout``)."""
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not 0 < value <= MAX_ACTION_TIMEOUT_S
    ):
        raise InvalidTaskCall(
            f"{where}: timeout must be seconds above 0 and at most {MAX_ACTION_TIMEOUT_S}, "
            f"not {value!r:.80}"
        )
    return float(value)


def attempts_policy(values: Mapping[str, Any]) -> Retry | None:
    """The ``Retry`` a task runs under: its ``retry``, or its ``max_attempts`` and
    ``backoff`` as one (``check_together`` refused both).

    ``max_attempts`` is ``Retry.max_attempts``, so the bound is the kernel's own,
    sealed with the run's input and counted by its sealed failure count (#47). A
    number ``backoff`` is a constant delay (no doubling, no jitter); without one,
    or with a function (asked for each delay on the worker), ``Retry``'s defaults.
    """
    attempts = values["max_attempts"]
    if attempts is None or attempts == 1:
        policy: Retry | None = values["retry"]
        return policy
    backoff = values["backoff"]
    if isinstance(backoff, float):
        return Retry(
            max_attempts=attempts, backoff=backoff, max_backoff=backoff, jitter=False, multiplier=1
        )
    return Retry(max_attempts=attempts)


def _unique(value: Any, where: str) -> Unique | None:
    try:
        return check_unique(value, where)
    except InvalidInput as exc:
        raise InvalidTaskCall(str(exc)) from None


def _fairness(value: Any, where: str) -> Fairness | None:
    try:
        return check_fairness(value, where)
    except InvalidInput as exc:
        raise InvalidTaskCall(str(exc)) from None


def check_unique_keys(task: Any, unique: Unique | None, where: str) -> None:
    """A ``Unique(keys=...)`` names parameters of the task's function: a misspelt key
    would make every call its own key."""
    if unique is not None and unique.keys is not None:
        check_parameters(task, unique.keys, "Unique(keys=...)", where)


def check_fairness_key(task: Any, fairness: Fairness | None, where: str) -> None:
    """A ``Fairness(key=...)`` names a parameter of the task's function: a misspelt key
    would put every call under one key (its value would be missing: None)."""
    if fairness is not None:
        check_parameters(task, (fairness.key,), "Fairness(key=...)", where)


def check_parameters(task: Any, names: Sequence[str], what: str, where: str) -> None:
    """``names`` are parameters of the task's function (without the context a
    ``takes_context`` task receives first), or any name if it takes ``**kwargs``."""
    try:
        parameters = list(inspect.signature(task.func).parameters.values())
    except (TypeError, ValueError):
        return  # no signature Python can read: the call is not bound either
    if getattr(task, "takes_context", False):
        parameters = parameters[1:]
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return
    named = {p.name for p in parameters if p.kind is not inspect.Parameter.VAR_POSITIONAL}
    missing = [name for name in names if name not in named]
    if missing:
        raise InvalidTaskCall(
            f"{where}: {what} names {missing}, "
            f"not among the task's parameters ({', '.join(sorted(named)) or 'none'})"
        )


# -- how they are written to the run's input and read back -----------------------------


def retry_to_json(policy: Retry | None) -> dict[str, Any] | None:
    if policy is None:
        return None
    cap = policy.max_backoff
    value: dict[str, Any] = {
        "max_attempts": policy.max_attempts,
        "backoff_s": _seconds(policy.backoff),
        "max_backoff_s": None if cap is None else _seconds(cap),
        "jitter": policy.jitter,
        "multiplier": policy.multiplier,
    }
    if policy.on:  # written only when given: the input of every other task is unchanged
        value["on"] = list(policy.on)
    return value


def retry_from_json(value: dict[str, Any] | None) -> Retry | None:
    if value is None:
        return None
    policy = Retry(
        max_attempts=value["max_attempts"],
        backoff=value["backoff_s"],
        max_backoff=value["max_backoff_s"],
        jitter=value["jitter"],
        multiplier=value["multiplier"],
    )
    object.__setattr__(policy, "on", _on_from_json(value.get("on", ())))
    return policy


def _on_from_json(paths: Any) -> tuple[str, ...]:
    """``Retry.on`` as a run's input holds it, kept as the paths it names: the worker
    matches a raised exception's classes by name and imports none of them (a class
    whose module is gone from the worker still names what it named)."""
    if not isinstance(paths, list | tuple) or not all(isinstance(p, str) for p in paths):
        raise InvalidInput(f"the task's Retry.on must be a list of class paths, not {paths!r:.80}")
    return tuple(paths)


def rate_limit_to_json(limit: RateLimit | None) -> dict[str, Any] | None:
    return None if limit is None else {"limit": limit.limit, "per_ms": limit.per_ms}


def rate_limit_from_json(value: dict[str, Any] | None) -> RateLimit | None:
    if value is None:
        return None
    return RateLimit(value["limit"], dt.timedelta(milliseconds=value["per_ms"]))


def concurrency_to_json(declared: Concurrency | None) -> dict[str, Any] | None:
    if declared is None:
        return None
    return {"limit": declared.limit, "strategy": Strategy(declared.strategy).value}


def concurrency_from_json(limit: Any) -> Concurrency | None:
    if limit is None:
        return None
    if not isinstance(limit, dict):
        raise InvalidInput(f"the task's concurrency must be an object, not {limit!r:.80}")
    return Concurrency(limit.get("limit", 1), limit.get("strategy", Strategy.QUEUE))


def _reconcile_from_input(value: Any) -> str | None:
    if value is None:
        return None
    return validation.text(value, "the task's reconcile", max_length=MAX_PATH)


def _seconds(value: dt.timedelta | float) -> float:
    return value.total_seconds() if isinstance(value, dt.timedelta) else float(value)


#: The run input's ``backoff`` of a function that does not import back by its path (a
#: lambda): the worker asks the task it imports for its ``backoff``.
BACKOFF_ON_TASK = "task"


def _backoff_to_input(value: Any) -> str:
    """A backoff function as the run's input holds it: its dotted path, or ``BACKOFF_ON_TASK``."""
    return value if isinstance(value, str) else BACKOFF_ON_TASK


def _backoff_from_input(value: Any) -> str | None:
    if value is None:
        return None
    return validation.text(value, "the task's backoff", max_length=MAX_PATH)


def _timeout_from_input(value: Any) -> float | None:
    try:
        return _timeout(value, "the task's input")
    except InvalidTaskCall as exc:
        raise InvalidInput(str(exc)) from None


def _has_budget(options: TaskOptions) -> bool:
    """A budget's part of the input is written only for a task with one, so that the
    input (sealed, shown, stored per call) of every other task is unchanged."""
    return bool(options.effect_budget)


# -- the options -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class TaskOptions:
    """Every option of one task, checked, as its backend enqueues it.

    The first four are Django's own (the task's path, backend, queue and
    priority, which ``Task.using()`` changes); the others are declared
    (``WorkflowsTask``'s fields, else ``OPTIONS``): ``effect``, what a crash
    while it runs does; ``retry``; ``rate_limit``; ``concurrency``, at most
    ``limit`` calls at once (its key is the task's path); ``effect_budget``
    (unit -> int, empty: none) and ``cost`` (a dict, or a callable's path),
    what one call may charge and charges.
    """

    path: str = option(
        key="task",
        decode=lambda input: validation.text(input["task"], "the task path", max_length=MAX_PATH),
    )
    backend: str = option(key="backend", decode=lambda input: input.get("backend", "default"))
    queue: str = option(
        key="queue",
        decode=lambda input: validation.text(
            input.get("queue", "default"), "the task's queue", max_length=100
        ),
    )
    priority: int = option(
        key="priority",
        decode=lambda input: check_priority(input.get("priority", 0), "the task's priority"),
    )
    effect: str = option(check=_effect, default="external")
    retry: Retry | None = option(
        check=_retry,
        key="retry",
        encode=retry_to_json,
        decode=lambda input: retry_from_json(input.get("retry")),
    )
    rate_limit: RateLimit | None = option(
        check=lambda value, where: check_rate_limit(where, value),
        key="rate_limit",
        encode=rate_limit_to_json,
        decode=lambda input: rate_limit_from_json(input.get("rate_limit")),
    )
    concurrency: Concurrency | None = option(
        check=_concurrency,
        key="concurrency",
        encode=concurrency_to_json,
        decode=lambda input: concurrency_from_json(input.get("concurrency")),
    )
    effect_budget: dict[str, int] = option(
        check=check_effect_budget,
        key="effect_budget",
        decode=lambda input: check_effect_budget(
            input.get("effect_budget"), f"task {input['task']}"
        ),
        written=_has_budget,
    )
    cost: dict[str, int] | str | None = option(
        check=_cost_spec, key="cost", decode=lambda input: input.get("cost"), written=_has_budget
    )
    #: Not in the run's input: the start reads it (the run's ``unique_key``), no worker
    #: (``from_input`` leaves it None).
    unique: Unique | None = dataclasses.field(
        default=None, metadata={"option": Option(check=_unique)}
    )
    #: Not in the options of the run's input either: each call's key and weight are
    #: (``WorkflowsBackend.run_input``), which the start reads (``runs.run_columns``).
    fairness: Fairness | None = dataclasses.field(
        default=None, metadata={"option": Option(check=_fairness)}
    )
    reconcile: str | None = option(
        check=_reconcile,
        key="reconcile",
        decode=lambda input: _reconcile_from_input(input.get("reconcile")),
        written=lambda options: options.reconcile is not None,
    )
    # Django's proposed options (django/new-features #142, #144). ``max_attempts`` and a
    # number ``backoff`` are held by ``retry`` (``attempts_policy``); a backoff function
    # by its path; ``timeout`` is the step's ``Action.timeout``.
    max_attempts: int | None = option(optional=True, check=_max_attempts)
    backoff: float | str | Callable[..., Any] | None = option(
        optional=True,
        check=_backoff,
        key="backoff",
        encode=_backoff_to_input,
        decode=lambda input: _backoff_from_input(input.get("backoff")),
        written=lambda options: (
            options.backoff is not None and not isinstance(options.backoff, float)
        ),
    )
    timeout: float | None = option(
        optional=True,
        check=_timeout,
        key="timeout",
        decode=lambda input: _timeout_from_input(input.get("timeout")),
        written=lambda options: options.timeout is not None,
    )

    @property
    def workflow_name(self) -> str:
        """The workflow its calls run as: its effect's."""
        return WORKFLOW_NAMES[self.effect]

    @classmethod
    def defaults(cls, alias: str, configured: Mapping[str, Any]) -> dict[str, Any]:
        """The declared options of the tasks of backend ``alias`` that declare none, from its
        ``OPTIONS``: unknown keys and bad values are ``ImproperlyConfigured``.
        ``OPTIONS["tasks"]`` is read by ``TaskOverride.all``."""
        unknown = set(configured) - set(DECLARED) - {TASKS_KEY}
        if unknown:
            raise ImproperlyConfigured(
                f"TASKS[{alias!r}]['OPTIONS'] has unknown keys {sorted(unknown)}: "
                f"known are {sorted([*DECLARED, TASKS_KEY])}"
            )
        where = f"TASKS[{alias!r}]['OPTIONS']"
        try:
            values = {
                name: spec.check(configured.get(name, spec.default), where)  # type: ignore[misc]
                for name, spec in DECLARED.items()
            }
            check_together(where, values)
        except InvalidInput as exc:
            raise ImproperlyConfigured(str(exc)) from None
        return values

    @classmethod
    def of(
        cls,
        task: Any,
        alias: str,
        defaults: Mapping[str, Any],
        overrides: Sequence[TaskOverride] = (),
    ) -> TaskOptions:
        """The options of ``task`` on backend ``alias``: each as the task declares it,
        else as the most specific of ``overrides`` (``OPTIONS["tasks"]``) that names
        the task and declares it, else ``defaults`` (``TaskOptions.defaults``).
        Raises ``InvalidInput``."""
        path = task_path(task)
        where = f"task {path}"
        matching = [o for o in overrides if o.matches(path)]
        values = {}
        for name, spec in DECLARED.items():
            declared = getattr(task, name, None)
            if declared is not None:
                values[name] = spec.check(declared, where)  # type: ignore[misc]
                continue
            given = next((o for o in matching if name in o.values), None)
            values[name] = defaults[name] if given is None else given.values[name]
        if matching:
            where = f"{where} (with OPTIONS['tasks'] {', '.join(o.pattern for o in matching)})"
        check_together(where, values)
        values["retry"] = attempts_policy(values)
        check_unique_keys(task, values["unique"], where)
        check_fairness_key(task, values["fairness"], where)
        return cls(
            path=path, backend=alias, queue=task.queue_name, priority=task.priority, **values
        )

    def to_input(self) -> dict[str, Any]:
        """The run input's part that is the task's, the same for all its calls."""
        return {
            key: spec.encode(getattr(self, name))
            for name, (key, spec) in IN_INPUT.items()
            if spec.written is None or spec.written(self)
        }

    @classmethod
    def from_input(cls, input: Mapping[str, Any], effect: str) -> TaskOptions:
        """The options a run's ``input`` holds, checked (``effect`` is its workflow's)."""
        return cls(effect=effect, **{name: input_option(input, name) for name in IN_INPUT})


#: The key of ``OPTIONS`` that gives tasks one does not own their options.
TASKS_KEY = "tasks"


@dataclasses.dataclass(frozen=True, slots=True)
class TaskOverride:
    """One entry of a backend's ``OPTIONS["tasks"]``: options for the tasks a pattern names.

    For tasks one does not own (a library's bare ``@task()``): ``pattern`` is a
    task's path (``"app.tasks.charge"``) or a module prefix ending in ``.*``
    (``"wagtail.images.tasks.*"``, every task under it). ``values`` are the options
    it declares, checked as ``OPTIONS``' own.
    """

    pattern: str
    values: dict[str, Any]

    @property
    def prefix(self) -> str | None:
        """The module prefix of a ``.*`` pattern, with its dot; None for a task's path."""
        return self.pattern[:-1] if self.pattern.endswith(".*") else None

    def matches(self, path: str) -> bool:
        prefix = self.prefix
        return path == self.pattern if prefix is None else path.startswith(prefix)

    def specificity(self) -> tuple[int, int]:
        """A task's own path before any prefix; a longer prefix before a shorter one."""
        prefix = self.prefix
        return (1, 0) if prefix is None else (0, len(prefix))

    @classmethod
    def all(cls, alias: str, configured: Mapping[str, Any]) -> tuple[TaskOverride, ...]:
        """``OPTIONS["tasks"]`` of backend ``alias``, checked, the most specific first.

        A pattern or a value that cannot be right is ``ImproperlyConfigured`` when the
        backend is made; a pattern that names no task is the system check's (it
        imports the task, which a backend must not do while Django loads).
        """
        given = configured.get(TASKS_KEY)
        where = f"TASKS[{alias!r}]['OPTIONS'][{TASKS_KEY!r}]"
        if given is None:
            return ()
        if not isinstance(given, Mapping):
            raise ImproperlyConfigured(
                f"{where} must be a dict of task path (or 'module.*') -> options, "
                f"not {type(given).__name__}"
            )
        overrides = []
        for pattern, values in given.items():
            here = f"{where}[{pattern!r}]"
            if not isinstance(pattern, str) or not _PATTERN.fullmatch(pattern):
                raise ImproperlyConfigured(
                    f"{where}: {pattern!r:.100} is not a task's dotted path nor a module "
                    "prefix ending in '.*' (e.g. 'app.tasks.charge', 'wagtail.images.tasks.*')"
                )
            if not isinstance(values, Mapping) or not values:
                raise ImproperlyConfigured(
                    f"{here} must be a non-empty dict of options, not {values!r:.80}"
                )
            unknown = set(values) - set(DECLARED)
            if unknown:
                raise ImproperlyConfigured(
                    f"{here} has unknown keys {sorted(unknown)}: known are {sorted(DECLARED)}"
                )
            try:
                checked = {
                    name: DECLARED[name].check(value, here)  # type: ignore[misc]
                    for name, value in values.items()
                }
            except InvalidInput as exc:
                raise ImproperlyConfigured(str(exc)) from None
            overrides.append(cls(pattern, checked))
        overrides.sort(key=cls.specificity, reverse=True)
        return tuple(overrides)


#: A task's path, or a module prefix ending in ``.*``: dotted Python identifiers.
_PATTERN = re.compile(_DOTTED.pattern + r"(\.\*)?|[A-Za-z_]\w*\.\*")


def _options() -> dict[str, Option]:
    return {f.name: f.metadata["option"] for f in dataclasses.fields(TaskOptions)}


#: The options a task or ``OPTIONS`` declares (the others are Django's own).
DECLARED = {name: spec for name, spec in _options().items() if spec.check is not None}
#: The options the run's input holds: name -> (its key in the input, its ``Option``).
IN_INPUT = {name: (spec.key, spec) for name, spec in _options().items() if spec.key is not None}
_DECODE = {name: spec.decode for name, (_, spec) in IN_INPUT.items()}


def input_option(input: Mapping[str, Any], name: str) -> Any:
    """Option ``name`` as a task run's ``input`` holds it, checked: what a worker reads
    of one option, without reading the others."""
    decode = _DECODE[name]
    assert decode is not None
    return decode(input)


def check_input(input: Any) -> None:
    """That ``input`` is a task run's input at all: a task's workflow started by hand
    (``start_workflow_run("k2b.task.pure", ...)``) is refused naming what to do."""
    if not isinstance(input, dict) or not isinstance(input.get("task"), str):
        raise InvalidInput(
            "a task run's input is the call enqueue() builds ({'task': 'module.path', ...}): "
            "enqueue the task instead of starting its workflow"
        )


# -- the options together --------------------------------------------------------------


def check_together(where: str, values: Mapping[str, Any]) -> None:
    """What the declared options may not be together: a reconcile is for an external
    task; ``retry`` or ``max_attempts``/``backoff``, not both; a backoff needs
    attempts to space; a budget and a cost go together, on a task with an effect to guard.

    A budget without a cost charges nothing and guards nothing; a cost without
    a budget is charged against no limit. A pure task has no effect to guard
    (and the kernel charges a pure step with its result, after it ran). A fixed
    cost over its budget fails every call: refused with the declaration.
    """
    if values["reconcile"] is not None and values["effect"] != "external":
        raise InvalidTaskCall(
            f"{where}: reconcile applies to an external task (the only one whose outcome a "
            f"crash leaves unknown), not to a {values['effect']} one: a {values['effect']} "
            "call is run again instead"
        )
    _check_attempts(where, values)
    budget, cost = values["effect_budget"], values["cost"]
    if not budget and cost is None:
        return
    if not budget:
        raise InvalidTaskCall(
            f"{where}: cost without an effect_budget is charged against no limit: "
            "give effect_budget= too, or leave cost out"
        )
    if cost is None:
        raise InvalidTaskCall(
            f"{where}: an effect_budget without a cost charges nothing: give cost= "
            "(a dict of unit -> int, or a module-level function of the call's arguments)"
        )
    if values["effect"] == "pure":
        raise InvalidTaskCall(
            f"{where}: a pure task has no effect to budget (its charge would be made after "
            "it ran): declare it idempotent or external, or leave effect_budget out"
        )
    if isinstance(cost, dict):
        try:
            fixed = call_cost(cost, (), {}, budget)
        except InvalidInput as exc:
            raise InvalidTaskCall(f"{where}: {exc}") from None
        check_within(where, fixed, budget)


def _check_attempts(where: str, values: Mapping[str, Any]) -> None:
    """Django's ``max_attempts``/``backoff`` or this package's ``retry``: one of them.

    Both would be two answers to "how often, how patiently": which one wins is a
    rule nobody reading the declaration would guess, so neither does. The same
    holds across sources: a task's ``max_attempts`` on a backend whose ``OPTIONS``
    declare a ``retry`` is refused naming both.
    """
    attempts, backoff = values["max_attempts"], values["backoff"]
    if values["retry"] is not None and (attempts is not None or backoff is not None):
        given = " and ".join(
            name for name in ("max_attempts", "backoff") if values[name] is not None
        )
        raise InvalidTaskCall(
            f"{where}: retry=Retry(...) and {given} both say how the task is retried: "
            "declare one of them (Retry(max_attempts=..., backoff=...) says the same)"
        )
    if backoff is not None and (attempts is None or attempts == 1):
        raise InvalidTaskCall(
            f"{where}: backoff spaces retries, and max_attempts={attempts} allows none: "
            "give max_attempts=2 or more, or leave backoff out"
        )


def check_within(where: str, cost: dict[str, int], budget: dict[str, int]) -> None:
    for unit, amount in cost.items():
        if amount > budget[unit]:
            raise InvalidTaskCall(
                f"{where}: a cost of {amount} {unit!r} is over the effect_budget of "
                f"{budget[unit]} (a worker would fail the call with EFFECT_BUDGET_EXCEEDED "
                "and never call the task)"
            )


# -- what a call costs ----------------------------------------------------------------


def call_cost(spec: Any, args: Any, kwargs: Any, budget: dict[str, int]) -> dict[str, int]:
    """What one call of a task charges: its declared ``cost`` (``spec``: a dict of
    unit -> int, or the module path of a callable taking the call's arguments),
    checked as the kernel checks a cost, and against ``budget``'s units.

    A unit the budget does not name is refused rather than charged without a
    limit: a typo (``"cent"`` for ``"cents"``) would turn the guard off
    unseen. Raises ``InvalidInput``; the enqueue turns it into ``InvalidTaskCall``,
    the worker into ``INVALID_TASK_COST``.
    """
    if spec is None:
        return {}
    if isinstance(spec, str):
        try:
            price = import_callable(spec)
            value = price(*args, **kwargs)
        except InvalidInput:
            raise
        except BaseException as exc:  # as a task's own: SystemExit fails this call only
            raise InvalidInput(f"cost {spec}() raised {type(exc).__name__}: {exc}") from exc
        if inspect.iscoroutine(value):
            value.close()
            raise InvalidInput(f"cost {spec}() is async: a cost is computed synchronously")
        where = f"cost {spec}()"
    else:
        value, where = spec, "cost"
    cost = checked_cost(value, where)
    unknown = sorted(set(cost) - set(budget))
    if unknown:
        raise InvalidInput(
            f"{where} charges {unknown} that the effect_budget {budget} does not limit"
        )
    return cost


def checked_cost(value: Any, where: str) -> dict[str, int]:
    """``value`` checked as the kernel checks a cost (``validate_cost``), the error
    naming ``where`` it came from."""
    try:
        return validate_cost(value)
    except InvalidInput:
        raise InvalidInput(
            f"{where} must be a dict of unit (1-100 characters) -> int from 0 to 2**31-1, "
            f"not {value!r:.200}"
        ) from None


def import_callable(path: str) -> Any:
    """The callable at module ``path``: a task's cost, imported where it is computed."""
    try:
        found = import_string(path)
    except ImportError as exc:
        raise InvalidInput(f"cost {path} does not import here: {exc}") from exc
    if not callable(found):
        raise InvalidInput(f"cost {path} is not callable")
    return found
