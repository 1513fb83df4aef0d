"""What the backend raises: Django's exceptions and this package's at once.

A caller written for any django.tasks backend catches Django's class; one
written for k2b_workflows catches ``InvalidInput``: each class here is both,
so that neither misses a refusal. Below the options and the backend, which
both raise them.
"""

from __future__ import annotations

from ..exceptions import InvalidInput
from .compat import InvalidTask, TaskResultMismatch


class InvalidTaskCall(InvalidInput, InvalidTask):  # type: ignore[misc,valid-type]
    """A task or a call of it that the backend refuses: Django's ``InvalidTask`` and
    this package's ``InvalidInput`` at once, so either ``except`` catches it."""


class InvalidTaskArguments(InvalidTaskCall, TypeError):
    """Arguments the task's function does not take (one short, one too many, an unknown
    keyword): refused at the enqueue, where Python refuses such a call, and a
    ``TypeError`` as Python's own is. Accepted, the call failed on the worker, after
    the caller had moved on (#47)."""


class TaskRunNotSealed(TaskResultMismatch):  # type: ignore[misc,valid-type]
    """A task run whose start fields (its input: the task path, the call) do not match
    their seal: the row was changed after the enqueue, by a role with SQL access and
    no evidence key. Raised by ``get_result`` (so by ``TaskResult.refresh`` and the
    async forms) before anything of the row is used: its task path is never imported.
    Django's ``TaskResultMismatch``: the row is not the result of the task enqueued.

    Before #47 the path was imported first: a runtime role that named ``this.x``
    ran module ``this``'s top-level code in the caller's process, and the
    ``TaskResultMismatch`` that followed did not say why. ``run_id`` is the run,
    ``reason`` what does not match.
    """

    def __init__(self, run_id: object, reason: str) -> None:
        super().__init__(
            f"task run {run_id}: its start seal does not verify, the row was changed after "
            f"the enqueue ({reason}); nothing of it was used, its task path was not imported"
        )
        self.run_id = run_id
        self.reason = reason


class TaskTimeout(TimeoutError):
    """A call of a task declared with ``timeout=`` that ran past it: the attempt's error
    (``TaskResult.errors``), as Django's proposal names it. A ``TimeoutError``, so
    ``Retry(on=TimeoutError)`` and a ``backoff`` that looks at the exception see it.

    A pure or idempotent call fails with it and is retried under its attempts. An
    external call that ran past its timeout may have had its effect: its outcome is
    unknown (its ``reconcile``, else an operator), never retried blindly. A
    synchronous function cannot be stopped from outside: one still running at its
    timeout goes on until it returns, and what it returns then is not used.
    """

    def __init__(self, path: str, timeout: float, elapsed: float | None = None) -> None:
        ran = "" if elapsed is None else f" (ran {elapsed:.3g} s)"
        super().__init__(f"task {path} ran past its timeout of {timeout:g} s{ran}")
        self.path = path
        self.timeout = timeout
