"""System checks: the guarantees need PostgreSQL, the triggers, and sane settings."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from django.apps import AppConfig, apps
from django.conf import settings
from django.core.checks import CheckMessage, Error, Tags, Warning, register
from django.db import connections

from . import settings as k2b_settings
from .kernel.together import MAX_ENDS as MAX_PURE_ENDS_TOGETHER

if TYPE_CHECKING:
    from .actions import Action


# Not tagged "database": Django runs those only with ``check --database``, and
# the vendor is known without connecting.
@register(Tags.compatibility)
def check_database(
    app_configs: Sequence[AppConfig] | None = None, **kwargs: object
) -> list[CheckMessage]:
    errors: list[CheckMessage] = []
    alias = k2b_settings.database()
    if alias not in connections.databases:
        return [
            Error(
                f"K2B_WORKFLOWS['DATABASE'] names {alias!r}, which is not in DATABASES",
                id="k2b_workflows.E001",
            )
        ]
    vendor = connections[alias].vendor
    if vendor != "postgresql":
        errors.append(
            Error(
                f"k2b_workflows needs PostgreSQL; the database {alias!r} is {vendor}",
                hint="Its fencing, claiming and wake-ups rely on PostgreSQL row locks and NOTIFY.",
                id="k2b_workflows.E002",
            )
        )
    return errors


@register(Tags.compatibility)
def check_pgtrigger(
    app_configs: Sequence[AppConfig] | None = None, **kwargs: object
) -> list[CheckMessage]:
    errors: list[CheckMessage] = []
    if not apps.is_installed("pgtrigger"):
        errors.append(
            Error(
                "k2b_workflows needs 'pgtrigger' in INSTALLED_APPS",
                hint="The journal and ledger are append-only and the run lifecycle is enforced by "
                "django-pgtrigger triggers.",
                id="k2b_workflows.E003",
            )
        )
    if getattr(settings, "PGTRIGGER_MIGRATIONS", True) is False and not getattr(
        settings, "PGTRIGGER_INSTALL_ON_MIGRATE", False
    ):
        errors.append(
            Error(
                "PGTRIGGER_MIGRATIONS=False without PGTRIGGER_INSTALL_ON_MIGRATE drops the "
                "triggers k2b_workflows relies on",
                id="k2b_workflows.E004",
            )
        )
    meta = getattr(settings, "PGTRIGGER_MODEL_META", True)
    if meta is False:
        errors.append(
            Error(
                "PGTRIGGER_MODEL_META=False ignores the triggers declared on k2b_workflows models",
                id="k2b_workflows.E005",
            )
        )
    return errors


@register(Tags.compatibility)
def check_settings(
    app_configs: Sequence[AppConfig] | None = None, **kwargs: object
) -> list[CheckMessage]:
    errors: list[CheckMessage] = []
    configured = getattr(settings, "K2B_WORKFLOWS", {})
    if not isinstance(configured, dict):
        return [Error("K2B_WORKFLOWS must be a dict", id="k2b_workflows.E006")]
    unknown = set(configured) - k2b_settings.known_settings()
    if unknown:
        errors.append(
            Warning(
                f"unknown K2B_WORKFLOWS keys: {', '.join(sorted(unknown))}", id="k2b_workflows.W001"
            )
        )
    for key in (
        "RUN_LEASE_MS",
        "POLL_INTERVAL_MS",
        "RETRY_BACKOFF_MS",
        "RETRY_BACKOFF_MAX_MS",
        "MAX_CHILDREN_PER_STEP",
        "RUN_MAX_CONSECUTIVE_FAILURES",
        "ACTION_TIMEOUT_MS",
        "SHUTDOWN_GRACE_MS",
        "MAX_VALUE_BYTES",
        "AI_TASK_MAX_ATTEMPTS",
        "MAX_RECONCILE_POLLS",
        "WAKE_RETENTION_HOURS",
        "WORKER_HEARTBEAT_MS",
        "WORKER_LOST_AFTER_MS",
        "WORKER_PURGE_AFTER_MS",
        "SCHEDULE_MAX_CATCH_UP",
        "SCHEDULE_MISSED_AFTER_MS",
        "SCHEDULE_PASS_INTERVAL_MS",
        "PURE_ENDS_TOGETHER",
    ):
        value = configured.get(key)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value <= 0
        ):
            errors.append(
                Error(
                    f"K2B_WORKFLOWS[{key!r}] must be a positive int, not {value!r}",
                    id="k2b_workflows.E007",
                )
            )
    together = configured.get("PURE_ENDS_TOGETHER")
    if isinstance(together, int) and together > MAX_PURE_ENDS_TOGETHER:
        # Each end that joins runs the next run inside it, on the thread's stack.
        errors.append(
            Error(
                f"K2B_WORKFLOWS['PURE_ENDS_TOGETHER'] is at most {MAX_PURE_ENDS_TOGETHER}, "
                f"not {together!r}",
                id="k2b_workflows.E007",
            )
        )
    prefetch = configured.get("CLAIM_PREFETCH")
    if prefetch is not None and (not isinstance(prefetch, int) or prefetch < 0):
        errors.append(
            Error(
                f"K2B_WORKFLOWS['CLAIM_PREFETCH'] must be a non-negative int, not {prefetch!r}",
                id="k2b_workflows.E007",
            )
        )
    if not errors and k2b_settings.lease_ms() < 500:
        errors.append(
            Warning(
                "RUN_LEASE_MS below 500 ms: leases renewed every third of it will expire "
                "under load",
                id="k2b_workflows.W002",
            )
        )
    listen = configured.get("LISTEN_DATABASE")
    if listen is not None and listen not in settings.DATABASES:
        errors.append(
            Error(
                f"K2B_WORKFLOWS['LISTEN_DATABASE'] is {listen!r}, which is not in DATABASES",
                id="k2b_workflows.E009",
            )
        )
    if not errors and k2b_settings.worker_lost_after_ms() <= 2 * k2b_settings.worker_heartbeat_ms():
        # A worker busy for one slow beat would be reported lost while alive.
        errors.append(
            Warning(
                "WORKER_LOST_AFTER_MS should be more than two WORKER_HEARTBEAT_MS",
                id="k2b_workflows.W004",
            )
        )
    if not errors and k2b_settings.retry_backoff_max_ms() < k2b_settings.retry_backoff_ms():
        errors.append(
            Error("RETRY_BACKOFF_MAX_MS is smaller than RETRY_BACKOFF_MS", id="k2b_workflows.E008")
        )
    return errors


def _concrete_actions() -> list[type[Action]]:
    from .actions import Action

    found: list[type[Action]] = []
    stack = list(Action.__subclasses__())
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        if not cls.__dict__.get("abstract", False) and cls not in found:
            found.append(cls)
    return sorted(found, key=lambda c: (c.__module__, c.__qualname__))


@register(Tags.compatibility)
def check_actions(
    app_configs: Sequence[AppConfig] | None = None, **kwargs: object
) -> list[CheckMessage]:
    """Actions whose defaults would surprise after a crash, a rename or a dry run.

    A missing ``effect`` is refused when the class is created (``Action``);
    what is left are warnings: a non-PURE action without ``plan()`` makes
    every dry run of its workflows fail, and a defaulted ``name`` changes
    when the class is renamed or moved, which makes journaled runs
    nondeterministic.
    """
    from .actions import Effect

    warnings: list[CheckMessage] = []
    for cls in _concrete_actions():
        label = f"{cls.__module__}.{cls.__qualname__}"
        if cls.effect != Effect.PURE and not cls.defines("plan"):
            warnings.append(
                Warning(
                    f"action {label} is {cls.effect.name} and defines no plan()",
                    hint="dry runs call plan() instead of run() for every non-PURE action: "
                    'return succeeded({"planned": True, ...}, summary=...)',
                    obj=cls,
                    id="k2b_workflows.W010",
                )
            )
        if not cls.__dict__.get("name") and not any(
            base.__dict__.get("name") for base in cls.__mro__[1:-2]
        ):
            warnings.append(
                Warning(
                    f"action {label} sets no name; the journal records it as {label!r}",
                    hint="set name = 'app.verb' so that renaming or moving the class does not "
                    "break replay of journaled runs",
                    obj=cls,
                    id="k2b_workflows.W011",
                )
            )
    return warnings


# Not a deploy check alone (#47): a site is set up with a plain ``check`` (and the
# ``runserver`` and ``migrate`` that run it), and a fresh project witnesses
# nothing; ``check --deploy`` runs it too. Its id stays W040, so a site that
# silenced it keeps it silenced.
@register(Tags.security)
def check_witness(
    app_configs: Sequence[AppConfig] | None = None, **kwargs: object
) -> list[CheckMessage]:
    """``check`` (and ``check --deploy``): the witness records go somewhere (#35, #47).

    They are the only detection of an owner's rollback or a restored backup;
    without a ``WITNESS_SINK`` or a handler of ``k2b_workflows.witness`` at
    INFO they are dropped, silently.
    """
    from .kernel import witness

    if witness.goes_somewhere():
        return []
    return [
        Warning(
            "the witness records (k2b_workflows.witness at INFO) go nowhere: without them a"
            " rolled-back run or a restored backup that repeats effects is not detected",
            hint='LOGGING["loggers"]["k2b_workflows.witness"] = {"handlers": [<a handler>],'
            ' "level": "INFO"}, or K2B_WORKFLOWS["WITNESS_SINK"] (docs/security.md#the-witness)',
            id="k2b_workflows.W040",
        )
    ]


@register(Tags.database)
def check_runtime_role(
    app_configs: Sequence[AppConfig] | None = None,
    databases: Sequence[str] | None = None,
    **kwargs: object,
) -> list[CheckMessage]:
    """Warn when web and workers connect as a role that could rewrite the evidence."""
    alias = k2b_settings.database()
    if not databases or alias not in databases or connections[alias].vendor != "postgresql":
        return []
    from django.db import DatabaseError

    from .roles import excess_privileges

    try:
        problems = excess_privileges(alias)
    except DatabaseError:
        return []  # no database yet: check_database and migrate say so
    if not problems:
        return []
    return [
        Warning(
            f"the role of database {alias!r} can bypass the append-only evidence: "
            + "; ".join(problems),
            hint="Connect web and workers as a runtime role holding only what "
            "'manage.py grantworkflows ROLE' grants, and migrate and purge through "
            "K2B_WORKFLOWS['OWNER_DATABASE'] (see docs/security.md).",
            id="k2b_workflows.W003",
        )
    ]


#: What the kernel's locking assumes: each statement sees what committed before it.
READ_COMMITTED = "read committed"


_ISOLATION_SQL = "SELECT pg_catalog.current_setting('transaction_isolation')"


@register(Tags.database)
def check_isolation_level(
    app_configs: Sequence[AppConfig] | None = None,
    databases: Sequence[str] | None = None,
    **kwargs: object,
) -> list[CheckMessage]:
    """Warn when the kernel's database does not run at READ COMMITTED (#38).

    The kernel assumes it: a claim that waited on a row lock re-reads the row
    as it committed, a waiter reading the run inside an unrelated transaction
    sees its end, and a fenced write that lost its generation updates nothing
    rather than raising a serialization error every retry path would have to
    know. Under REPEATABLE READ or SERIALIZABLE those become errors or stale
    reads. Two places set it: Django's connection (``OPTIONS["isolation_level"]``,
    or the server's default) and the kernel's own autocommit connections (the
    lease keeper, the heartbeat: only the server's, role's or database's
    ``default_transaction_isolation``), so both are read.
    """
    alias = k2b_settings.database()
    if not databases or alias not in databases or connections[alias].vendor != "postgresql":
        return []
    import psycopg
    from django.db import DatabaseError, transaction

    from .kernel import db

    query = _ISOLATION_SQL
    try:
        with transaction.atomic(using=alias), connections[alias].cursor() as cursor:
            cursor.execute(query)
            djangos = str(cursor.fetchone()[0])
        with db.autocommit_connection(alias, follow_clock=False) as conn:
            row = conn.execute(query).fetchone()
            own = str(row[0]) if row else READ_COMMITTED
    except (DatabaseError, psycopg.Error):
        return []  # no database yet: check_database and migrate say so
    found = [
        f"{where} at {level}"
        for where, level in (
            ("Django's connection", djangos),
            ("the kernel's own connections", own),
        )
        if level != READ_COMMITTED
    ]
    if not found:
        return []
    return [
        Warning(
            f"database {alias!r} runs transactions of "
            + " and of ".join(found)
            + f"; the kernel assumes {READ_COMMITTED.upper()}",
            hint="Remove OPTIONS['isolation_level'] from the database's settings and reset "
            "default_transaction_isolation (ALTER ROLE/DATABASE ... RESET "
            "default_transaction_isolation): PostgreSQL's default is READ COMMITTED.",
            id="k2b_workflows.W005",
        )
    ]


@register(Tags.database)
def check_replication(
    app_configs: Sequence[AppConfig] | None = None,
    databases: Sequence[str] | None = None,
    **kwargs: object,
) -> list[CheckMessage]:
    """Warn when the primary has only asynchronous standbys: a failover can repeat an effect.

    The ledger's "dispatched" entry commits before an EXTERNAL call; a failover
    that loses that commit leaves the kernel no trace of the call, and it calls
    again. Silence with ``SILENCED_SYSTEM_CHECKS = ["k2b_workflows.W020"]`` once
    that window is accepted (docs/high-availability.md).
    """
    alias = k2b_settings.database()
    if not databases or alias not in databases or connections[alias].vendor != "postgresql":
        return []
    from django.db import DatabaseError

    from .worker import topology

    try:
        setup = topology.replication(alias)
    except DatabaseError:
        return []
    if not setup.repeats_possible:
        return []
    return [
        Warning(
            f"database {alias!r}: {setup.describe()}",
            hint="Set synchronous_standby_names on the primary (docs/high-availability.md), or "
            "accept the window and silence this check.",
            id=topology.ASYNC_STANDBY_CHECK,
        )
    ]


# Tagged "database": it reads the schedule table (``check --database``, ``migrate``).
# Warnings, not errors: an error would stop the very ``migrate`` that fixes it.
@register(Tags.database)
def check_schedules(
    app_configs: Sequence[AppConfig] | None = None,
    databases: Sequence[str] | None = None,
    **kwargs: object,
) -> list[CheckMessage]:
    """Schedules that cannot fire as written: a bad spec, an unknown workflow or version,
    a decorator's schedule that its decorator no longer declares."""
    alias = k2b_settings.database()
    if not databases or alias not in databases or connections[alias].vendor != "postgresql":
        return []
    from django.db import DatabaseError

    from .exceptions import InvalidSchedule, UnknownWorkflow
    from .models import WorkflowSchedule
    from .workflows import get_workflow, registered_workflows

    try:
        rows = list(WorkflowSchedule.objects.using(alias).all())
    except DatabaseError:
        return []  # not migrated yet
    declared = {n for n, d in registered_workflows().items() if d.schedule is not None}
    problems: list[CheckMessage] = []
    for row in rows:
        label = f"schedule {row.schedule_id!r}"
        tampered = row.seal_problem()
        if tampered is not None:
            problems.append(
                Error(
                    f"{label} fires nothing: {tampered}",
                    hint="read every field on its admin page and save it there, or delete it"
                    " (docs/security.md)",
                    obj=row,
                    id="k2b_workflows.E033",
                )
            )
            continue
        if not row.enabled:
            problems.append(
                Warning(
                    f"{label} is disabled: {row.disabled_reason}",
                    hint="delete it in the admin, or declare it again",
                    obj=row,
                    id="k2b_workflows.W032",
                )
            )
            continue
        if row.source == WorkflowSchedule.Source.DECORATOR and row.schedule_id not in declared:
            problems.append(
                Warning(
                    f"{label}: the @workflow decorator no longer declares it",
                    hint="`migrate` disables it (it fires nothing once disabled)",
                    obj=row,
                    id="k2b_workflows.W032",
                )
            )
        try:
            row.spec()
        except InvalidSchedule as exc:
            problems.append(
                Warning(f"{label}: {exc.field}: {exc}", obj=row, id="k2b_workflows.W030")
            )
        try:
            get_workflow(row.workflow_name, row.workflow_version)
        except UnknownWorkflow as exc:
            problems.append(
                Warning(
                    f"{label}: workflow: {exc}",
                    hint="no worker can fire its ticks until that workflow (version) is deployed",
                    obj=row,
                    id="k2b_workflows.W031",
                )
            )
    return problems


@register(Tags.compatibility)
def check_task_overrides(
    app_configs: Sequence[AppConfig] | None = None, **kwargs: object
) -> list[CheckMessage]:
    """``OPTIONS["tasks"]`` patterns that name no task: options that would silently
    apply to nothing (a typo, a library that moved its tasks), so that its calls run
    with the effect nobody chose for them."""
    import importlib

    from django.utils.module_loading import import_string

    problems: list[CheckMessage] = []
    for alias, config in (getattr(settings, "TASKS", None) or {}).items():
        if not isinstance(config, dict) or not _is_our_backend(config.get("BACKEND")):
            continue
        options = config.get("OPTIONS") or {}
        patterns = options.get("tasks") or {}
        if not isinstance(patterns, dict):
            continue  # the backend refuses it when it is made, with the reason
        problems += _reconciles_import(alias, options, patterns)
        for pattern in patterns:
            label = f"TASKS[{alias!r}]['OPTIONS']['tasks'][{pattern!r}]"
            if not isinstance(pattern, str):
                continue
            if pattern.endswith(".*"):
                module = pattern[:-2]
                try:
                    importlib.import_module(module)
                except Exception as exc:
                    problems.append(
                        Error(
                            f"{label} names no task: module {module!r} does not import "
                            f"({type(exc).__name__}: {exc})",
                            id="k2b_workflows.E041",
                        )
                    )
                continue
            try:
                found = import_string(pattern)
            except Exception as exc:
                found, why = None, f"it does not import ({type(exc).__name__}: {exc})"
            else:
                why = f"it is {type(found).__name__}, not a task"
            backend = getattr(found, "backend", None) if _is_task(found) else None
            if backend is None:
                problems.append(Error(f"{label} names no task: {why}", id="k2b_workflows.E041"))
            elif backend != alias:
                problems.append(
                    Error(
                        f"{label}: that task is on backend {backend!r}, so these options "
                        "never apply to it",
                        hint=f"move the entry to TASKS[{backend!r}]['OPTIONS']['tasks']",
                        id="k2b_workflows.E041",
                    )
                )
    return problems


def _reconciles_import(alias: str, options: dict, patterns: dict) -> list[CheckMessage]:
    """Every ``reconcile`` settings name imports, as a callable: the backend does not
    import them (settings name them before their modules can be imported)."""
    from django.utils.module_loading import import_string

    named = [(f"TASKS[{alias!r}]['OPTIONS']['reconcile']", options.get("reconcile"))]
    named += [
        (f"TASKS[{alias!r}]['OPTIONS']['tasks'][{pattern!r}]['reconcile']", values.get("reconcile"))
        for pattern, values in patterns.items()
        if isinstance(values, dict)
    ]
    problems: list[CheckMessage] = []
    for label, path in named:
        if not isinstance(path, str):
            continue
        problem: str | None = None
        try:
            if not callable(import_string(path)):
                problem = "is not callable"
        except Exception as exc:
            problem = f"does not import ({type(exc).__name__}: {exc})"
        if problem is not None:
            problems.append(
                Error(
                    f"{label}: {path} {problem}: no worker could ask it, and every call it "
                    "should settle would wait for an operator",
                    id="k2b_workflows.E042",
                )
            )
    return problems


def _is_our_backend(path: object) -> bool:
    if not isinstance(path, str):
        return False
    try:
        from django.utils.module_loading import import_string

        from .tasks.backend import WorkflowsBackend

        found = import_string(path)
    except Exception:
        return False
    return isinstance(found, type) and issubclass(found, WorkflowsBackend)


def _is_task(value: object) -> bool:
    from .tasks.compat import base_api

    return isinstance(value, base_api.Task)
