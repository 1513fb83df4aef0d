"""Actions, effect classes and the results their hooks return.

An action is the only place a workflow touches the world. Its effect class
tells the kernel what is safe after a crash (see ``kernel/execute.py``).
Results are validated once, where they enter the kernel: ``validate_result``.
"""

from __future__ import annotations

import datetime as dt
import enum
import hashlib
import inspect
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from . import codes, validation
from .exceptions import HookNotDefined, InvalidInput
from .limits import RateLimit, check_rate_limit
from .retries import Retry, action_declared, check_policy
from .validation import canonical_json, to_json_value

if TYPE_CHECKING:
    import threading
    import uuid
    from contextlib import AbstractContextManager

    from django.db import transaction


class Effect(enum.StrEnum):
    """What the kernel may do with a step after a crash (docs/effects.md has the table).

    Members, weakest first:

    - ``PURE``: no effect outside the workflow; run again freely.
    - ``TRANSACTIONAL``: writes to the run's database in ``ctx.tx``, committed
      with the journal entry, or rolled back with it.
    - ``IDEMPOTENT``: an effect elsewhere that the provider (or your dedup
      table) deduplicates by ``ctx.effect_key``; run again with the same key.
    - ``EXTERNAL``: an effect elsewhere that may not be repeated: a "dispatched"
      ledger entry commits first; after a crash ``reconcile()`` or an operator
      decides.
    - ``IRREVERSIBLE``: as EXTERNAL, and refused unless the step pins
      ``approval_ref``.
    - ``SNAPSHOT_RESTORE``: as EXTERNAL, and refused unless the step pins
      ``backup_ref``.
    """

    PURE = "pure"
    TRANSACTIONAL = "transactional"
    IDEMPOTENT = "idempotent"
    EXTERNAL = "external"
    IRREVERSIBLE = "irreversible"
    SNAPSHOT_RESTORE = "snapshot_restore"

    def __str__(self) -> str:
        return self.value

    @property
    def is_external(self) -> bool:
        """True for the classes whose dispatch is recorded in the ledger first."""
        return self in (Effect.EXTERNAL, Effect.IRREVERSIBLE, Effect.SNAPSHOT_RESTORE)


# -- results ---------------------------------------------------------------


#: The furthest a wait's deadline may be: a century (a timedelta past it overflows
#: the datetime it is added to, and a run parked that long waits for nobody).
MAX_WAIT = dt.timedelta(days=36_525)


@dataclass(frozen=True)
class Dependency:
    """What a waiting step waits for: ``(app_id, kind, key)``, with an optional deadline.

    ``kind`` (at most 200 characters) and ``key`` (at most 500) are non-empty
    strings naming the rendezvous; the app is the run's own. ``deadline`` is
    one of:

    - ``None``: wait until woken, however long;
    - a ``datetime.timedelta``: that long from now on the kernel's clock
      (``ctx.now()``), e.g. ``timedelta(hours=24)``;
    - a ``datetime.datetime``: that moment (a naive one is read in Django's
      current time zone).

    When the deadline passes the run is queued again and the step runs again
    with the same ``effect_key`` and ``ctx.deadline_passed`` True: a deadline
    never fails a step by itself. Anything else is ``InvalidInput``.
    """

    kind: str
    key: str
    deadline: dt.datetime | dt.timedelta | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kind, str) or not self.kind:
            raise InvalidInput("Dependency.kind must be a non-empty string")
        if not isinstance(self.key, str) or not self.key:
            raise InvalidInput("Dependency.key must be a non-empty string")
        if self.deadline is not None and not isinstance(self.deadline, (dt.datetime, dt.timedelta)):
            raise InvalidInput("Dependency.deadline must be a datetime, a timedelta or None")


class Result:
    """Base of the values an action hook returns."""

    kind: ClassVar[str] = ""


@dataclass(frozen=True)
class Succeeded(Result):
    output: Any = None
    summary: str | None = None
    kind: ClassVar[str] = "succeeded"


@dataclass(frozen=True)
class Failed(Result):
    message: str = ""
    code: str | None = None
    retryable: bool = False
    #: A retryable failure's own delay before its retry, instead of its policy's (a
    #: task's ``backoff`` computes it from the exception); None: the policy's.
    delay_ms: int | None = None
    kind: ClassVar[str] = "failed"


@dataclass(frozen=True)
class Waiting(Result):
    dependency: Dependency = field(default=None)  # type: ignore[assignment]
    kind: ClassVar[str] = "waiting"


@dataclass(frozen=True)
class Ambiguous(Result):
    message: str | None = None
    kind: ClassVar[str] = "ambiguous"


@dataclass(frozen=True)
class Unknown(Result):
    message: str | None = None
    kind: ClassVar[str] = "unknown"


def succeeded(output: Any = None, summary: str | None = None) -> Succeeded:
    """The step happened; ``output`` (a JSON value) is what replay returns."""
    return Succeeded(output, summary)


@dataclass(frozen=True)
class _ReadBack(Succeeded):
    """A success whose ``output`` is already ``to_json_value``'s: what it will read back as."""


def succeeded_as_stored(output: Any, summary: str | None = None) -> Succeeded:
    """``succeeded(to_json_value(value), summary)`` for code that normalized the value
    itself (a task's return value, checked where Django's own backends check it):
    ``validate_result`` then takes ``output`` as it is instead of encoding and
    decoding it a second time. Anything else passed here would be stored unchecked.
    """
    return _ReadBack(output, summary)


def failed(message: str, code: str | None = None, retryable: bool = False) -> Failed:
    """The step did not happen. Retryable failures are tried again with backoff."""
    return Failed(message, code, retryable)


def waiting(dependency: Dependency) -> Waiting:
    """Park the run until ``dependency`` is woken or its deadline passes.

    From ``run()`` only before any effect. From ``reconcile()``: the provider has
    the request but not the answer yet; it is asked again on a wake or at the deadline.
    """
    if not isinstance(dependency, Dependency):
        raise InvalidInput("waiting() takes a Dependency")
    return Waiting(dependency)


def ambiguous(message: str | None = None) -> Ambiguous:
    """The effect may or may not have happened: handled like a crash after dispatch."""
    return Ambiguous(message)


def unknown(message: str | None = None) -> Unknown:
    """From ``reconcile()`` only: the provider cannot tell whether the effect happened."""
    return Unknown(message)


class InvalidResult(Exception):
    """A hook returned something that is not an allowed result, or a non-JSON output."""


def validate_result(result: Any, allowed: tuple[type[Result], ...], hook: str) -> Result:
    """Check a hook's return value once, where it enters the kernel.

    Everything the kernel will store from it is checked here too (output,
    summary, code, wait key): a value PostgreSQL refuses must be an invalid
    result now, not a failed commit after the action ran, which the worker
    could only treat as a crash.
    """
    if not isinstance(result, allowed):
        names = ", ".join(cls.kind for cls in allowed)
        raise InvalidResult(f"{hook}() returned {type(result).__name__}, expected one of: {names}")
    try:
        if isinstance(result, Succeeded):
            if type(result) is _ReadBack:
                output = result.output
            else:
                output = to_json_value(result.output, f"{hook}() output")
            if result.summary is not None:
                validation.text(result.summary, f"{hook}() summary", required=False)
            return Succeeded(output, result.summary)
        if isinstance(result, Failed):
            if not isinstance(result.message, str):
                raise InvalidInput(f"{hook}() failed(): message must be a string")
            if result.code is not None:
                validation.text(result.code, f"{hook}() failed() code", max_length=100)
            message = validation.storable_message(result.message)
            delay = result.delay_ms
            if delay is not None and (
                isinstance(delay, bool) or not isinstance(delay, int) or delay < 0
            ):
                raise InvalidInput(
                    f"{hook}() failed(): delay_ms must be an int >= 0, not {delay!r}"
                )
            return Failed(message, result.code, result.retryable, delay)
        if isinstance(result, Waiting):
            dependency = result.dependency
            validation.text(dependency.kind, f"{hook}() waiting() kind", max_length=200)
            validation.text(dependency.key, f"{hook}() waiting() key", max_length=500)
            deadline = dependency.deadline
            if isinstance(deadline, dt.timedelta) and abs(deadline) > MAX_WAIT:
                # now + deadline would overflow (or outlive any store of the run).
                raise InvalidInput(
                    f"{hook}() waiting() deadline is {deadline.days} days away: "
                    f"at most {MAX_WAIT.days} days"
                )
            return result
        if isinstance(result, (Ambiguous, Unknown)) and result.message is not None:
            return type(result)(validation.storable_message(result.message))
    except InvalidInput as exc:
        raise InvalidResult(str(exc)) from None
    return result


# -- the step context --------------------------------------------------------


class StepContext(Protocol):
    """``ctx``: what every hook of an action receives, the kernel's side of a step.

    Declared here, implemented by the kernel (``kernel/context.py``) and by dry
    runs: an action depends on this protocol, never on the kernel, so the
    definitions import nothing above them.

    ``effect_key`` is stable for the step across retries, crashes, new
    generations, deadline re-runs and an operator's "effect absent" retry, and
    different for every other step: pass it to the provider or to your own
    dedup table. ``invocation_key`` (EXTERNAL and stronger) names this
    dispatch: the ``effect_key`` plus the attempt. ``generation`` is the fence
    this execution holds. ``tx`` is set for TRANSACTIONAL steps only: the open
    ``transaction.atomic`` the journal commits in (``ctx.tx.using`` is its
    alias). ``principal`` is the JSON given as ``principal=`` to
    ``start_workflow_run``. ``canceled`` is set when the run ended under the
    step (a timeout, a lost lease: what it returns is discarded) and once a
    cancel asked the run to stop (``cancel_workflow_run``: the step may stop
    early, and what it returns is still its result). ``deadline_passed`` is
    True when this step parked on a wait with a deadline and runs again
    because the deadline passed (rather than being woken).
    """

    run_id: uuid.UUID
    root_run_id: uuid.UUID
    app_id: str
    step: int
    effect_key: str
    invocation_key: str | None
    generation: int
    principal: Any
    canceled: threading.Event
    tx: transaction.Atomic | None
    deadline_passed: bool
    dry_run: bool

    @property
    def using(self) -> str:
        """The database alias the run lives on."""
        ...

    def now(self) -> dt.datetime:
        """The kernel's current time (aware, UTC): what ``k2b_now()`` reads, with no query."""
        ...

    def heartbeat(self, tx: str | None = None) -> None:
        """Check that this execution still owns the run, and extend its lease.

        With ``tx`` (an alias inside an open ``transaction.atomic``): lock the
        run row until that block commits. Without: renew from a separate
        connection. Raises ``LeaseLost`` or ``RunCanceled``.
        """
        ...

    def fenced(self, using: str = "default") -> AbstractContextManager[None]:
        """``transaction.atomic`` + ``heartbeat(tx)``: commits only while the run is ours."""
        ...

    def ai_task(self, provider: str, request: Any) -> Result:
        """Succeeded once the durable AI task is done, failed if it failed, else waiting on it."""
        ...


# -- actions ---------------------------------------------------------------


class Action:
    """One kind of step. Subclass it, set ``name`` and ``effect``, write ``run``.

    ``effect`` is required: a subclass that declares none (itself or through a
    base) is refused when the class is created, because a charge that forgot
    ``effect = Effect.EXTERNAL`` would otherwise be re-run blindly after a
    crash. A base class meant only to be subclassed says so:
    ``class MailAction(Action, abstract=True)``.

    ``name`` is what the journal records for each step and what replay
    compares: set it to a stable string (``"mail.send"``). Without it the name
    is ``module.QualifiedClassName``, so renaming or moving the class makes
    journaled runs nondeterministic; ``manage.py check`` warns about it.

    Hooks are called by the worker thread: ``cost`` (cheap, side-effect free),
    ``plan`` (dry runs), ``authorize`` (just before the effect), ``run`` (the
    effect) and ``reconcile`` (after an unknown outcome). ``plan``,
    ``authorize``, ``run`` and ``reconcile`` may be ``async def`` (not ``cost``,
    nor a TRANSACTIONAL ``run``): see ``kernel/hooks.py``.
    """

    name: ClassVar[str] = ""
    """Stable and unique, e.g. ``"mail.send"``: the journal records it and replay compares it."""
    effect: ClassVar[Effect]
    """Required on every concrete subclass (no default: see the class docstring)."""
    #: True on a base class that only exists to be subclassed (set by ``abstract=True``).
    abstract: ClassVar[bool] = True
    version: ClassVar[int] = 1
    """Part of the definition hash: bump it when ``run`` changes meaning."""
    timeout: ClassVar[float | None] = None
    """Seconds the worker keeps renewing the lease while ``run`` executes (None: the
    ``ACTION_TIMEOUT_MS`` setting)."""
    #: How this action's steps are retried (``retries.Retry``); None: the workflow's
    #: policy, else the settings.
    retry: ClassVar[Retry | None] = None
    #: Dispatches of this action allowed per window, across every worker (None: unlimited).
    #: With ``rate_limit_key`` defined, one limit per key it returns.
    rate_limit: ClassVar[RateLimit | None] = None
    #: EXTERNAL and stronger: ``run()`` passes ``ctx.effect_key`` to a provider that
    #: deduplicates by it (an idempotency key). Then a ``reconcile()`` that answers
    #: ``failed(..., retryable=True)`` ("no charge under this key") dispatches again
    #: under the same key; without it that answer fails the step, since a lookup can
    #: lag behind the provider's own write and only the provider's dedup makes a second
    #: dispatch safe (docs/effects.md, "Absent: dispatch again under the same key").
    redispatch_when_absent: ClassVar[bool] = False

    def __init_subclass__(cls, abstract: bool = False, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.abstract = abstract
        effect = getattr(cls, "effect", None)
        if effect is None and not abstract:
            raise TypeError(
                f"{cls.__module__}.{cls.__qualname__} declares no effect: set "
                "effect = Effect.PURE (or TRANSACTIONAL, IDEMPOTENT, EXTERNAL, IRREVERSIBLE, "
                "SNAPSHOT_RESTORE), or declare a base class with abstract=True"
            )
        if effect is not None and not isinstance(effect, Effect):
            raise TypeError(f"{cls.__name__}.effect must be an Effect, not {effect!r}")
        policy = check_policy(cls.__dict__.get("retry"), f"{cls.__name__}.retry")
        if policy is not None:
            action_declared(policy)
        if effect == Effect.TRANSACTIONAL and inspect.iscoroutinefunction(cls.__dict__.get("run")):
            # run() writes through ctx.tx, this thread's connection inside the kernel's
            # transaction, which a coroutine cannot use without leaving the thread.
            raise InvalidInput(
                f"{cls.__name__}.run must be a plain def, not async def: a TRANSACTIONAL "
                "action writes in the kernel's transaction on the worker thread"
            )
        if inspect.iscoroutinefunction(cls.__dict__.get("cost")):
            # cost() is charged before dispatch, in the kernel's own transaction and
            # in dry runs: it must be a cheap synchronous computation.
            raise InvalidInput(
                f"{cls.__name__}.cost must be a plain def, not async def: it is computed "
                "synchronously before the step's effect (run, reconcile, authorize and plan "
                "may be coroutines)"
            )
        check_rate_limit(cls.__name__, cls.__dict__.get("rate_limit"))
        redispatch = cls.__dict__.get("redispatch_when_absent", False)
        if not isinstance(redispatch, bool):
            raise InvalidInput(
                f"{cls.__name__}.redispatch_when_absent must be True or False, not {redispatch!r}"
            )
        if redispatch and effect is not None and not effect.is_external:
            # Only a dispatched effect is reconciled; elsewhere the flag would mean nothing.
            raise InvalidInput(
                f"{cls.__name__}.redispatch_when_absent applies to EXTERNAL, IRREVERSIBLE and "
                f"SNAPSHOT_RESTORE actions, not {effect.name}"
            )
        _check_timeout(cls.__name__, cls.__dict__.get("timeout"))

    def cost(self, input: Any) -> dict[str, int]:
        """Units this step charges to the root run's ``effect_budget``, e.g. ``{"emails": 1}``.

        Cheap and side-effect free: it runs before every dispatch and in dry
        runs. Charged once per step, however often the step runs. Omitted: no
        charge.
        """
        return {}

    def plan(self, ctx: StepContext, input: Any) -> Result | Awaitable[Result]:
        """Dry runs only: what ``run`` would do, without doing it.

        Return ``succeeded({..., "planned": True}, summary="...")``. Required for
        every action that is not PURE (``manage.py check`` warns, W010).
        """
        raise HookNotDefined(f"{type(self).__name__} defines no plan(): dry runs need one")

    def authorize(self, ctx: StepContext, input: Any) -> Result | Awaitable[Result | None] | None:
        """Called just before the effect (and in dry runs): refuse it or return None.

        Raise ``django.core.exceptions.PermissionDenied`` or return
        ``failed(message, code="FORBIDDEN")``: the run fails ``FORBIDDEN``,
        never retried. ``ctx.principal`` is who started the run.
        """
        return None

    def run(self, ctx: StepContext, input: Any) -> Result | Awaitable[Result]:
        """The effect. Return ``succeeded``, ``failed``, ``waiting`` or ``ambiguous``.

        ``waiting`` only before any effect happened; an action that may have
        caused one returns ``ambiguous``. After an EXTERNAL dispatch an
        exception is an unknown outcome, not a failure (docs/effects.md).
        """
        raise HookNotDefined(f"{type(self).__name__} defines no run()")

    def reconcile(self, ctx: StepContext, input: Any) -> Result | Awaitable[Result]:
        """EXTERNAL and stronger, after an unknown outcome: did the effect happen?

        Look it up at the provider by ``ctx.effect_key`` and return
        ``succeeded(output)`` (it happened), ``failed(...)`` (it did not: the
        step fails), ``waiting(...)`` (the provider says "pending": ask again on
        a wake or the deadline) or ``unknown()`` (an operator decides).
        Without this hook the run needs an operator.
        """
        raise HookNotDefined(f"{type(self).__name__} defines no reconcile()")

    def rate_limit_key(self, input: Any) -> str:
        """Optional with ``rate_limit``: the key one limit counts under (an API key's id)."""
        raise HookNotDefined(f"{type(self).__name__} defines no rate_limit_key()")

    # -- introspection the kernel relies on --

    @classmethod
    def action_name(cls) -> str:
        return cls.name or f"{cls.__module__}.{cls.__qualname__}"

    @classmethod
    def defines(cls, hook: str) -> bool:
        """True when the subclass overrides ``hook`` (an omitted hook is not called)."""
        return getattr(cls, hook) is not getattr(Action, hook)

    @classmethod
    def definition_hash(cls) -> str:
        """sha256 over name, version and the class source: evidence of what ran."""
        cached = cls.__dict__.get("_k2b_definition_hash")
        if cached:
            return cached
        try:
            code = inspect.getsource(cls)
        except (OSError, TypeError):
            code = repr(cls.run.__code__.co_code)
        digest = hashlib.sha256(
            canonical_json([cls.action_name(), cls.version, cls.effect.value, code]).encode()
        ).hexdigest()
        cls._k2b_definition_hash = digest  # type: ignore[attr-defined]
        return digest


def missing_ref(
    action: Action, approval_ref: str | None, backup_ref: str | None
) -> tuple[str, str] | None:
    """(code, message) when an IRREVERSIBLE or SNAPSHOT_RESTORE step lacks its pinned ref."""
    name = action.action_name()
    if action.effect == Effect.IRREVERSIBLE and not approval_ref:
        return codes.APPROVAL_REQUIRED, f"{name} is IRREVERSIBLE: the step must pin approval_ref"
    if action.effect == Effect.SNAPSHOT_RESTORE and not backup_ref:
        return codes.BACKUP_REQUIRED, f"{name} is SNAPSHOT_RESTORE: the step must pin backup_ref"
    return None


def as_action(action: Any) -> Action:
    """Accept an ``Action`` subclass or instance, as ``run.step`` does."""
    if isinstance(action, type) and issubclass(action, Action):
        return action()
    if isinstance(action, Action):
        return action
    raise InvalidInput(f"run.step() takes an Action subclass or instance, not {action!r}")


#: The longest ``Action.timeout``: a year of seconds, well inside what the lease
#: keeper's clock and PostgreSQL's intervals hold.
MAX_ACTION_TIMEOUT_S = 366 * 86_400


def _check_timeout(owner: str, timeout: Any) -> None:
    """``timeout`` is None or a positive number of seconds (#35): 0 and -1 were accepted
    and not enforced (the lease was renewed as if no timeout were set)."""
    if timeout is None:
        return
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, int | float)
        or not 0 < timeout <= MAX_ACTION_TIMEOUT_S
    ):
        raise InvalidInput(
            f"{owner}.timeout must be None or seconds above 0 and at most "
            f"{MAX_ACTION_TIMEOUT_S}, not {timeout!r:.80}"
        )
