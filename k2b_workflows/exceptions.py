"""Exceptions users see, and the kernel's internal control-flow signals."""

from __future__ import annotations

from typing import Any


class WorkflowError(Exception):
    """Base class of the errors this app raises on purpose."""


class UnknownWorkflow(WorkflowError, LookupError):
    """No workflow is registered under that name (nothing was created)."""


class InvalidInput(WorkflowError, ValueError):
    """A value that must be JSON is not, or an argument is malformed."""


class InvalidSchedule(InvalidInput):
    """A schedule's spec is malformed; ``field`` names what is wrong (``cron``, ``every``, ...).

    Raised where a schedule is defined (``Schedule(...)``, ``schedule_workflow``),
    and turned into a form error on that field in the admin.
    """

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(message)
        self.field = field


class IdempotencyConflict(InvalidInput):
    """An ``idempotency_key`` already names a run started with a different input,
    or by another principal.

    Returning that run would silently drop the new input (a retried request
    that changed is a bug in the caller, as Stripe treats it). ``run_id`` is
    the existing run; None when it is another principal's, which the caller
    must not learn about.
    """

    def __init__(self, message: str, run_id: object) -> None:
        super().__init__(message)
        self.run_id = run_id


class HookNotDefined(WorkflowError, TypeError):
    """An action hook was called that the action does not define.

    The kernel checks ``Action.defines()`` before it calls the optional hooks
    (``plan``, ``reconcile``): this is what calling one directly raises.
    """


class StepFailed(WorkflowError):
    """A step failed for good; the workflow may catch it.

    Uncaught, the run fails with ``code``.
    """

    def __init__(self, code: str, message: str = "") -> None:
        super().__init__(f"{code}: {message}" if message else code)
        self.code = code
        self.message = message


class LeaseLost(WorkflowError):
    """This worker no longer holds the run: another generation owns it.

    Nothing this worker writes for the run afterwards can commit.
    """


class RunCanceled(WorkflowError):
    """The run was canceled while this worker executed it."""


class ResolutionRefused(WorkflowError):
    """``resolve_effect`` was called on a run that is not waiting for that decision."""


class EvidenceChanged(ResolutionRefused):
    """The ledger moved on since the operator looked: the decision was taken on old evidence.

    ``head`` is the newest ledger entry now, which the operator has not seen.
    """

    def __init__(self, message: str, head: Any = None) -> None:
        super().__init__(message)
        self.head = head


class RunEndNotSealed(WorkflowError):
    """A run's recorded end (status, output, error code) does not match its end seal.

    Raised by ``wait_for_workflow_run`` / ``await_workflow_run`` instead of
    returning the run: the end was not written by the kernel or an operator's
    resolution (a role with SQL access, no evidence key, wrote it), so its
    output must not be used. ``run_id`` is the run, ``reason`` what does not
    match; ``manage.py verifyworkflows`` names the run too (docs/security.md).
    """

    def __init__(self, run_id: object, reason: str) -> None:
        super().__init__(f"run {run_id}: {reason}")
        self.run_id = run_id
        self.reason = reason


class NotRetryable(WorkflowError):
    """An operator asked to retry a run that is not failed."""


class ForkRefused(WorkflowError):
    """A fork would run again steps whose external effect may have happened.

    ``steps``: each such step as a dict (``seq``, ``action``, ``effect``,
    ``state``: "dispatched", "confirmed" or "unknown"; ``children``: the child
    runs whose effects they are, for a children step). Name them in
    ``repeat_effects`` to fork anyway: the fork's ledger records who allowed it
    and why.
    """

    def __init__(self, run_id: object, steps: list[dict]) -> None:
        listed = ", ".join(
            f"step {s['seq']} ({s['action']}, {s['effect']}, {s['state']})" for s in steps
        )
        super().__init__(
            f"run {run_id}: forking would run again {listed}; name these steps in"
            " repeat_effects to repeat their effects"
        )
        self.run_id = run_id
        self.steps = steps


class DatabaseNotMigrated(WorkflowError):
    """The app's tables are missing or older than its code: ``manage.py migrate`` was not run."""


class DatabaseUnavailable(WorkflowError):
    """The database could not be reached within the time a caller was ready to wait."""


class Suspend(BaseException):
    """Unwinds workflow code when the kernel stops executing a run for now.

    A ``BaseException`` on purpose: workflow code that catches ``Exception``
    must not swallow a park, a retry or a lost lease and carry on.
    """
