"""``manage.py workflowrun start|show|cancel|retry|fork|wake|resolve``: one run, from a shell.

What this guards against: a second, laxer way to change a run. Every verb
calls the same control function the admin and user code call
(``start_workflow_run``, ``resolve_effect``, ...), so the validation, the
run-row lock, the ledger entry and the errors are theirs. ``retry``, ``fork`` and
``resolve`` act for a named Django user (``--actor``), who needs the
permission the admin asks for; the change is written to the admin's log
(``LogEntry``) with the message the admin writes, so the history of a run
reads the same whichever way an operator took.

Exit codes, for scripts (``--json`` prints the error as JSON on stdout too):

====  =====================================================================
0     done (``cancel`` of a run that had already ended is done, too)
1     refused: the run is not in a state for this (``NotRetryable``,
      ``ResolutionRefused``, ``EvidenceChanged``, ``IdempotencyConflict``,
      ``ForkRefused``)
2     bad input: usage, malformed JSON, a value the API refuses
3     not found: no such run, workflow or user
4     permission denied: the actor lacks the permission, or is inactive
5     the database is not migrated
====  =====================================================================
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any

from django.contrib.auth import get_user_model
from django.core.exceptions import PermissionDenied
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction

from k2b_workflows import control, incidents, naming, settings, validation
from k2b_workflows.exceptions import (
    DatabaseNotMigrated,
    EvidenceChanged,
    ForkRefused,
    IdempotencyConflict,
    InvalidInput,
    NotRetryable,
    ResolutionRefused,
    UnknownWorkflow,
)
from k2b_workflows.kernel import db
from k2b_workflows.management import arguments
from k2b_workflows.models import JournalEntry, LedgerEntry, RunStatus, WorkflowRun
from k2b_workflows.progress import progress_of
from k2b_workflows.redaction import redact, redact_text

if TYPE_CHECKING:
    from django.contrib.auth.base_user import AbstractBaseUser

OK, REFUSED, BAD_INPUT, NOT_FOUND, PERMISSION_DENIED, NOT_MIGRATED = range(6)

#: ``--decision`` values and the constants they stand for.
DECISIONS = {"confirmed": control.EFFECT_CONFIRMED, "absent": control.EFFECT_ABSENT}
#: What the admin asks of an operator before it shows the retry and cancel pages.
VIEW_PERMISSIONS = ("k2b_workflows.view_workflowrun", "k2b_workflows.change_workflowrun")


class Failure(Exception):
    """A verb's error: its exit code, a short kind for ``--json``, and the message."""

    def __init__(self, code: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.kind = kind


def _failure(exc: BaseException) -> Failure:
    """The control API's exceptions as exit codes; anything else is a bug and propagates."""
    message = arguments.printable(exc)
    if isinstance(exc, Failure):
        return exc
    if isinstance(
        exc,
        (EvidenceChanged, ResolutionRefused, NotRetryable, IdempotencyConflict, ForkRefused),
    ):
        return Failure(REFUSED, "refused", message)
    if isinstance(exc, (UnknownWorkflow, WorkflowRun.DoesNotExist)):
        return Failure(NOT_FOUND, "not_found", message)
    if isinstance(exc, InvalidInput):
        return Failure(BAD_INPUT, "invalid", message)
    if isinstance(exc, PermissionDenied):
        return Failure(PERMISSION_DENIED, "permission_denied", message)
    if isinstance(exc, DatabaseNotMigrated):
        return Failure(NOT_MIGRATED, "not_migrated", message)
    raise exc


def _json_option(text: str, option: str) -> Any:
    """A JSON argument; ``-`` reads it from standard input, ``@path`` from a file."""
    if text == "-":
        text = sys.stdin.read()
    elif text.startswith("@"):
        try:
            with open(text[1:], encoding="utf-8") as file:
                text = file.read()
        except OSError as exc:
            raise Failure(
                BAD_INPUT, "invalid", f"{option}: cannot read {text[1:]!r}: {exc.strerror}"
            ) from None
    try:
        return arguments.json_value(text, option)
    except CommandError as exc:
        raise Failure(BAD_INPUT, "invalid", str(exc)) from None


def _actor(username: str, *permissions: str, any_of: tuple[str, ...] = ()) -> AbstractBaseUser:
    """The Django user named ``username``, holding every permission and one of ``any_of``.

    The control functions check their own permission again; this adds what the
    admin asks on top (seeing runs at all) and names the missing permission.
    """
    User = get_user_model()
    try:
        user = User._default_manager.get_by_natural_key(username)
    except User.DoesNotExist:
        raise Failure(NOT_FOUND, "not_found", f"--actor: no user {username!r}") from None
    if not user.is_active:
        raise Failure(PERMISSION_DENIED, "permission_denied", f"--actor: {username!r} is inactive")
    for permission in permissions:
        if not user.has_perm(permission):
            raise Failure(
                PERMISSION_DENIED,
                "permission_denied",
                f"--actor: {username!r} lacks the permission {permission}",
            )
    if any_of and not any(user.has_perm(p) for p in any_of):
        raise Failure(
            PERMISSION_DENIED,
            "permission_denied",
            f"--actor: {username!r} lacks the permission {any_of[0]}",
        )
    return user


def _log_change(actor: AbstractBaseUser, run: WorkflowRun, message: str) -> None:
    """The admin's log entry for a change of ``run``: what ``ModelAdmin.log_change`` writes."""
    from django.contrib.admin.models import CHANGE, LogEntry

    LogEntry.objects.log_actions(
        user_id=actor.pk,
        queryset=[run],
        action_flag=CHANGE,
        change_message=message,
        single_object=True,
    )


def _when(value: Any) -> str | None:
    return None if value is None else value.isoformat()


def _name_line(run: WorkflowRun) -> str:
    """What ``show`` says the run is: a task call by its task's path and queue (#51)."""
    if run.display_name != run.workflow_name:
        described = naming.described_name(run.workflow_name, run.task_path)
        return f"task      {described} (queue {run.queue}, app {run.app_id})"
    return f"workflow  {run.workflow_name} v{run.workflow_version} (app {run.app_id})"


def _progress_line(progress: dict[str, Any]) -> str:
    """``progress 40 / 100 (40%) · the note (at ...)``: what ``set_progress`` last said."""
    done, total = progress["done"], progress["total"]
    shown = f"{done}" if total is None else f"{done} / {total}"
    if total is not None:
        shown += f" ({done / total:.0%})" if total else " (100%)"
    note = f" · {progress['note']}" if progress["note"] else ""
    return f"progress  {shown}{note} (at {progress['updated_at']})"


def describe(run: WorkflowRun, *, steps: bool = False) -> dict[str, Any]:
    """A run as ``--json`` prints it: its state, never its input (as the admin, redacted output)."""
    data: dict[str, Any] = {
        "id": str(run.pk),
        "workflow": run.workflow_name,
        "task": run.task_path,
        "queue": run.queue,
        "version": run.workflow_version,
        "app_id": run.app_id,
        "status": run.status,
        "error_code": run.error_code,
        "error_message": redact_text(run.error_message),
        "generation": run.generation,
        "consecutive_failures": run.consecutive_failures,
        "current_step": run.current_step,
        "attention_step": run.attention_step,
        "parent": None if run.parent_id is None else str(run.parent_id),
        "root": None if run.root_id is None else str(run.root_id),
        "forked_from": None if run.forked_from_id is None else str(run.forked_from_id),
        "idempotency_key": redact_text(run.idempotency_key),
        "created_at": _when(run.created_at),
        "updated_at": _when(run.updated_at),
        "finished_at": _when(run.finished_at),
        "output": redact(run.output),
    }
    if run.status == "waiting":
        data["waiting_on"] = {
            "kind": run.wait_kind,
            "key": run.wait_key,
            "step": run.wait_step,
            "deadline": _when(run.wait_deadline),
            "since": _when(run.waiting_since),
        }
    if steps:
        using = run._state.db or settings.database()
        data["steps"] = [
            {
                "seq": e.seq,
                "action": e.action_name,
                "effect": e.effect,
                "state": e.state,
                "error_code": e.error_code,
                "summary": redact_text(e.summary),
            }
            for e in JournalEntry.objects.using(using).filter(run_id=run.pk).order_by("seq")
        ]
        ledger = LedgerEntry.objects.using(using).filter(run_id=run.pk).order_by("-id").first()
        data["ledger_head"] = None if ledger is None else {"id": ledger.pk, "kind": ledger.kind}
        progress = progress_of(run)
        data["progress"] = None
        if progress is not None:
            data["progress"] = {
                "done": progress.done,
                "total": progress.total,
                "note": redact_text(progress.note),
                "updated_at": _when(progress.updated_at),
            }
    return data


class Command(BaseCommand):
    help = (
        "Start, show, cancel, retry, fork, wake or resolve a workflow run, with the checks of the "
        "Python API. Exit codes: 0 done, 1 refused by the run's state, 2 bad input, 3 not "
        "found, 4 permission denied, 5 database not migrated."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

        def verb(name: str, help: str) -> Any:
            sub = verbs.add_parser(name, help=help, description=help)
            sub.add_argument(
                "--json", action="store_true", dest="as_json", help="print the result as JSON"
            )
            return sub

        def run_id(sub: Any) -> None:
            sub.add_argument("run_id", help="the run's id (a UUID)")

        start = verb("start", "queue a run of a workflow (start_workflow_run)")
        start.add_argument("name", type=arguments.text(200), help="the workflow's registered name")
        start.add_argument(
            "--input", default="{}", help="the input as JSON; - reads stdin, @FILE a file"
        )
        start.add_argument("--idempotency-key", type=arguments.text(255), default=None)
        start.add_argument("--principal", default=None, help="the access context as JSON")
        start.add_argument(
            "--version",
            dest="workflow_version",
            type=arguments.integer(1, 2**31 - 1),
            default=None,
            help="pin this registered version (default: the newest)",
        )
        # Every argument of start_workflow_run a caller gives (#38); the API checks
        # them (the priority's range, a naive run_after, a key without concurrency=).
        start.add_argument(
            "--concurrency-key",
            type=arguments.text(255),
            default=None,
            help="the key whose active runs the workflow's concurrency= limits",
        )
        start.add_argument(
            "--priority",
            type=arguments.integer(-(2**31), 2**31 - 1),
            default=0,
            help="0 to 1000, higher claimed first (default 0)",
        )
        start.add_argument(
            "--run-after",
            type=arguments.aware_datetime,
            default=None,
            metavar="DATETIME",
            help="no claim before this ISO 8601 time with its offset (2026-12-24T09:00:00+01:00)",
        )

        show = verb("show", "a run's state, its steps and the newest ledger entry")
        run_id(show)

        cancel = verb("cancel", "cancel a run and its children (cancel_workflow_run)")
        run_id(cancel)
        cancel.add_argument("--reason", required=True, help="kept in the ledger")
        cancel.add_argument(
            "--actor",
            metavar="USERNAME",
            default=None,
            help="cancel as this user: needs k2b_workflows.cancel_workflowrun; logged as the "
            "admin logs it",
        )

        retry = verb("retry", "retry a failed or code-incident run now (retry_workflow_run)")
        run_id(retry)
        retry.add_argument(
            "--actor",
            metavar="USERNAME",
            required=True,
            help="the operator: needs k2b_workflows.retry_workflowrun",
        )
        retry.add_argument("--reason", required=True, help="kept in the ledger with the actor")

        fork = verb(
            "fork", "a new run that goes on from a step of an ended run (fork_workflow_run)"
        )
        run_id(fork)
        fork.add_argument(
            "--from-step",
            required=True,
            metavar="SEQ|failure",
            help="the step to run from: its seq in the run's journal, or failure",
        )
        fork.add_argument(
            "--actor",
            metavar="USERNAME",
            required=True,
            help="the operator: needs k2b_workflows.fork_workflowrun",
        )
        fork.add_argument("--reason", required=True, help="kept in the ledger with the actor")
        fork.add_argument(
            "--repeat-effect",
            dest="repeat_effects",
            metavar="SEQ",
            type=arguments.integer(0, 2**31 - 1),
            action="append",
            default=[],
            help="a step whose effect may have happened, to run again (repeatable)",
        )
        fork.add_argument(
            "--version",
            dest="workflow_version",
            type=arguments.integer(1, 2**31 - 1),
            default=None,
            help="run on this registered version (default: the newest)",
        )

        wake = verb("wake", "wake the runs waiting on (app, kind, key)")
        wake.add_argument("--app", dest="app_id", required=True)
        wake.add_argument("--kind", required=True)
        wake.add_argument("--key", required=True)

        resolve = verb("resolve", "decide on an effect whose outcome is unknown (resolve_effect)")
        run_id(resolve)
        resolve.add_argument("--decision", required=True, choices=sorted(DECISIONS))
        resolve.add_argument("--evidence", required=True, help="what you checked and found")
        resolve.add_argument(
            "--actor",
            metavar="USERNAME",
            required=True,
            help="the operator: needs k2b_workflows.resolve_effect",
        )
        resolve.add_argument(
            "--output",
            default=None,
            help="required with confirmed, refused otherwise: the step's output as JSON; "
            "- reads stdin, @FILE a file",
        )
        resolve.add_argument(
            "--step",
            type=arguments.integer(0, 2**31 - 1),
            default=None,
            help="refuse unless the run awaits a decision on this step",
        )
        resolve.add_argument(
            "--seen-ledger-id",
            type=arguments.integer(1, 2**63 - 1),
            default=None,
            help="refuse if evidence newer than this ledger entry arrived",
        )

    def handle(self, *args: Any, verb: str, as_json: bool, **options: Any) -> None:
        try:
            with db.schema_required():
                result = getattr(self, f"_{verb}")(**options)
        except Exception as exc:
            failure = _failure(exc)
            if as_json:
                self.stdout.write(
                    json.dumps({"ok": False, "error": failure.kind, "message": str(failure)})
                )
            raise CommandError(str(failure), returncode=failure.code) from None
        data, text = result
        if as_json:
            self.stdout.write(json.dumps({"ok": True, **data}, sort_keys=True))
        else:
            self.stdout.write(text)

    # -- verbs: each returns (data for --json, text) -----------------------------------------

    def _start(
        self,
        *,
        name: str,
        input: str,
        idempotency_key: str | None,
        principal: str | None,
        workflow_version: int | None,
        concurrency_key: str | None = None,
        priority: int = 0,
        run_after: Any = None,
        **options: Any,
    ) -> tuple[dict, str]:
        run = control.start_workflow_run(
            name,
            _json_option(input, "--input"),
            idempotency_key=idempotency_key,
            principal=None if principal is None else _json_option(principal, "--principal"),
            version=workflow_version,
            concurrency_key=concurrency_key,
            priority=priority,
            run_after=run_after,
        )
        return {"run": describe(run)}, f"{run.pk} {run.status}"

    def _show(self, *, run_id: str, **options: Any) -> tuple[dict, str]:
        run = _get_run(run_id)
        data = describe(run, steps=True)
        lines = [
            f"run       {data['id']}",
            _name_line(run),
            f"status    {run.status}" + (f" {run.error_code}" if run.error_code else ""),
            f"gen       {run.generation}  failures {run.consecutive_failures}",
        ]
        if data["error_message"]:
            lines.append(f"error     {data['error_message']}")
        if "waiting_on" in data:
            on = data["waiting_on"]
            lines.append(f"waits on  {on['kind']} {on['key']} (deadline {on['deadline'] or '-'})")
        if run.attention_step is not None:
            lines.append(f"attention step {run.attention_step}")
        if data["progress"] is not None:
            lines.append(_progress_line(data["progress"]))
        if run.status == RunStatus.NEEDS_ATTENTION:
            # The admin's incident box says the same, from the same rows.
            story = incidents.story_of(run)
            data["what_happened"] = story
            if story:
                lines.append("what happened:")
                lines.extend(f"  {sentence}" for sentence in story)
        for step in data["steps"]:
            lines.append(
                f"  step {step['seq']:>3}  {step['action']}  {step['effect']}  {step['state']}"
                + (f" {step['error_code']}" if step["error_code"] else "")
            )
        return {"run": data}, "\n".join(arguments.printable(line) for line in lines)

    def _cancel(self, *, run_id: str, reason: str, actor: str | None, **options: Any) -> tuple:
        user = None
        given = reason
        if actor is not None:
            user = _actor(actor, "k2b_workflows.cancel_workflowrun", any_of=VIEW_PERMISSIONS)
            reason = f"{reason} (by {user.get_username()})"
        found = _get_run(run_id)
        before, asked_before = found.status, found.cancel_requested_at is not None
        # As the admin: the cancel retries its own transaction on a deadlock, then the log.
        run = control.cancel_workflow_run(run_id, reason)
        # A running run is asked (#49): it ends canceled at its next step boundary.
        asked = run.cancel_requested_at is not None and not asked_before
        changed = run.status != before or asked
        if user is not None and changed:
            _log_change(user, run, f"Cancel: {given}")
        if asked and run.status == before:
            said = f"{run.pk} {run.status} (asked to stop: it ends canceled before its next step)"
        else:
            said = f"{run.pk} {run.status}" + ("" if changed else f" (already {before})")
        return {"run": describe(run), "changed": changed}, said

    def _retry(self, *, run_id: str, actor: str, reason: str, **options: Any) -> tuple:
        user = _actor(actor, "k2b_workflows.retry_workflowrun", any_of=VIEW_PERMISSIONS)
        with transaction.atomic(using=settings.database()):
            run = control.retry_workflow_run(run_id, actor=user, reason=reason)
            _log_change(user, run, f"Retry now: {reason}")
        # The admin's words for the same retry.
        return {"run": describe(run)}, control.retry_words(run)

    def _fork(
        self,
        *,
        run_id: str,
        from_step: str,
        actor: str,
        reason: str,
        repeat_effects: list[int],
        workflow_version: int | None,
        **options: Any,
    ) -> tuple:
        user = _actor(actor, "k2b_workflows.fork_workflowrun", any_of=VIEW_PERMISSIONS)
        step: int | str = int(from_step) if from_step.isdigit() else from_step
        with transaction.atomic(using=settings.database()):
            original = _get_run(run_id)
            try:
                run = control.fork_workflow_run(
                    original.pk,
                    from_step=step,
                    actor=user,
                    reason=reason,
                    repeat_effects=repeat_effects,
                    version=workflow_version,
                )
            except ForkRefused as exc:
                steps = ", ".join(str(s["seq"]) for s in exc.steps)
                raise Failure(
                    REFUSED, "refused", f"{arguments.printable(exc)} (--repeat-effect {steps})"
                ) from None
            detail = run.ledger.get(kind=LedgerEntry.Kind.FORKED).detail or {}
            _log_change(
                user, original, f"Forked from step {detail.get('from_step')} as {run.pk}: {reason}"
            )
        return {"run": describe(run)}, f"{run.pk} {run.status}"

    def _wake(self, *, app_id: str, kind: str, key: str, **options: Any) -> tuple:
        woken = control.wake_workflow_runs_waiting_on(app_id=app_id, kind=kind, key=key)
        return {"woken": woken}, f"{woken} run(s) woken"

    def _resolve(
        self,
        *,
        run_id: str,
        decision: str,
        evidence: str,
        actor: str,
        output: str | None,
        step: int | None,
        seen_ledger_id: int | None,
        **options: Any,
    ) -> tuple:
        from k2b_workflows.admin.views import resolution_message

        user = _actor(actor, "k2b_workflows.resolve_effect")
        if output is not None and DECISIONS[decision] != control.EFFECT_CONFIRMED:
            raise Failure(BAD_INPUT, "invalid", "--output is for --decision confirmed only")
        if output is None and DECISIONS[decision] == control.EFFECT_CONFIRMED:
            # The output is journaled as the step's result: without one the workflow
            # went on with None and crashed on it. The admin's form requires it too.
            raise Failure(
                BAD_INPUT,
                "invalid",
                "--output is required with --decision confirmed: the step's output as JSON "
                "(null if the action returns none)",
            )
        value = None if output is None else _json_option(output, "--output")
        with transaction.atomic(using=settings.database()):
            attention_step = _get_run(run_id).attention_step
            run = control.resolve_effect(
                run_id,
                DECISIONS[decision],
                evidence=evidence,
                actor=user,
                output=value,
                step=step,
                seen_ledger_id=seen_ledger_id,
            )
            _log_change(
                user, run, resolution_message(attention_step, DECISIONS[decision], evidence)
            )
        return {"run": describe(run)}, f"{run.pk} {run.status}"


def _get_run(run_id: str) -> WorkflowRun:
    pk = validation.run_id(run_id)
    run = WorkflowRun.objects.using(settings.database()).filter(pk=pk).first()
    if run is None:
        raise WorkflowRun.DoesNotExist(f"no run {pk}")
    return run
