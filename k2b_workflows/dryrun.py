"""Dry runs: execute a workflow with ``plan()`` in place of every effect.

Nothing is written to the database and no non-PURE ``run()`` is ever called.
``cost()`` and ``authorize()`` run as they would in execution, so the report
tells what a real run would be charged and whether it would be allowed.
"""

from __future__ import annotations

import copy
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any, NoReturn

from django.core.exceptions import PermissionDenied

from . import codes, settings, validation
from .actions import (
    Effect,
    Failed,
    InvalidResult,
    Result,
    Succeeded,
    Waiting,
    as_action,
    failed,
    missing_ref,
    validate_result,
)
from .exceptions import InvalidInput, StepFailed, Suspend, UnknownWorkflow
from .kernel import ai, hooks
from .kernel.budgets import AI_CALLS, validate_cost
from .kernel.context import KernelStepContext
from .models import WorkflowRun
from .validation import to_json_value
from .workflows import DEFAULT_MAX_STEPS, ChildResult, get_workflow

MAX_DEPTH = 5
#: Steps of a whole dry-run tree (root, children, grandchildren). Each run is
#: also held to its own ``max_steps``; this bounds the product of fan-out and
#: loops, so a dry run (in the admin, a web process) always ends quickly.
MAX_DRY_RUN_STEPS = 10_000


@dataclass
class DryRunStep:
    seq: int
    action: str
    effect: str
    summary: str
    output: Any
    cost: dict[str, int]
    run: str = ""  # "" for the root, else the child path such as "1[2]" (step 1, child 2)
    error: str = ""  # the code the step would fail with, such as FORBIDDEN


@dataclass
class DryRunReport:
    workflow: str
    steps: list[DryRunStep] = field(default_factory=list)
    cost: dict[str, int] = field(default_factory=dict)
    budget: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    output: Any = None
    failed: str | None = None
    #: Steps and children counted so far across the tree (the dry run's own bounds).
    step_count: int = 0
    children: int = 0
    max_children: int = DEFAULT_MAX_STEPS

    @property
    def within_budget(self) -> bool:
        """Each unit of the budget (and ``ai_calls``, for ``max_ai_calls``) is within limit."""
        return all(self.cost.get(unit, 0) <= limit for unit, limit in self.budget.items())

    @property
    def ok(self) -> bool:
        return not self.errors and self.failed is None and self.within_budget


class _DryExecution:
    """Enough of an ``Execution`` for workflow code and ``ctx``, writing nothing."""

    dry_run = True

    def __init__(
        self,
        report: DryRunReport,
        principal: Any,
        app_id: str,
        path: str,
        depth: int,
        max_steps: int = DEFAULT_MAX_STEPS,
    ) -> None:
        self.report = report
        self.max_steps = max_steps
        self.run_id = uuid.uuid4()
        self.root_id = self.run_id
        self.app_id = app_id
        self.generation = 0
        self.principal = principal
        self.canceled = threading.Event()
        self.using = settings.database()
        self.path = path
        self.depth = depth
        self.next_seq = 0
        self.ai_calls = 0  # AI tasks the current step asked for

    def patched(self, patch_id: str) -> bool:
        """A dry run is a new run: it takes every patch (and its marker takes a step number)."""
        self.next_seq += 1
        return True

    def sleep(self, duration: Any = None, until: Any = None) -> None:
        """A dry run does not wait: the timer is checked and passes at once (taking its
        step number, as in execution)."""
        from .kernel import timers

        self.next_seq += 1
        if duration is not None:
            timers.check_duration(duration)
        else:
            timers.check_instant(until)

    def deprecate_patch(self, patch_id: str) -> None:
        """A new run journals no marker for a deprecated patch."""

    def _error(self, message: str) -> NoReturn:
        self.report.errors.append(f"{self.path or 'root'}: {message}")
        raise Suspend

    def step(
        self,
        action: Any,
        input: Any,
        *,
        approval_ref: str | None = None,
        backup_ref: str | None = None,
    ) -> Any:
        seq = self.next_seq
        self.next_seq += 1
        action = as_action(action)
        name = action.action_name()
        try:
            input = to_json_value(input, f"input of step {seq} ({name})", stored=False)
        except InvalidInput as exc:
            self._error(str(exc))
        effect = action.effect
        self._count_step(seq, name, effect)
        refused = missing_ref(action, approval_ref, backup_ref)
        if refused is not None:
            self._refused(seq, name, effect, *refused)
        ctx = KernelStepContext(self, seq, dry_run=True)  # type: ignore[arg-type]
        try:
            cost = validate_cost(action.cost(input)) if action.defines("cost") else {}
        except Exception as exc:
            self._error(f"step {seq} ({name}): cost() failed: {exc}")
        if action.defines("authorize"):
            try:
                denial = hooks.call(action.authorize, ctx, input)
            except PermissionDenied as exc:
                denial = Failed(str(exc) or "permission denied", codes.FORBIDDEN)
            if isinstance(denial, Failed):
                self._refused(seq, name, effect, denial.code or codes.FORBIDDEN, denial.message)
        if effect == Effect.PURE:
            hook = "run"
        elif action.defines("plan"):
            hook = "plan"
        else:
            self._error(f"step {seq} ({name}): a {effect.name} action must define plan()")
        self.ai_calls = 0
        try:
            result = validate_result(
                hooks.call(getattr(action, hook), ctx, input), (Succeeded, Failed, Waiting), hook
            )
        except InvalidResult as exc:
            self._error(f"step {seq} ({name}): {exc}")
        except StepFailed as exc:  # a kernel service refused, as it would in execution
            self._refused(seq, name, effect, exc.code, exc.message)
        except Exception as exc:
            self._error(f"step {seq} ({name}): {hook}() raised {type(exc).__name__}: {exc}")
        if isinstance(result, Failed):
            self._refused(seq, name, effect, result.code or codes.ACTION_FAILED, result.message)
        if isinstance(result, Waiting):
            self._error(f"step {seq} ({name}): {hook}() returned waiting; a plan must succeed")
        assert isinstance(result, Succeeded)
        if hook == "plan" and not (
            isinstance(result.output, dict) and result.output.get("planned") is True
        ):
            self._error(f'step {seq} ({name}): plan() output must say "planned": True')
        if self.ai_calls:
            cost = {**cost, AI_CALLS: cost.get(AI_CALLS, 0) + self.ai_calls}
        self._count(cost)
        self.report.steps.append(
            DryRunStep(
                seq=seq,
                action=name,
                effect=effect.value,
                summary=result.summary or "",
                output=result.output,
                cost=cost,
                run=self.path,
            )
        )
        return copy.deepcopy(result.output)

    def _count_step(self, seq: int, name: str, effect: Effect) -> None:
        """The loop budgets of a real run: ``max_steps`` per run, and a bound on the whole tree."""
        # Counted first: workflow code that catches the StepFailed and loops still ends.
        self.report.step_count += 1
        if self.report.step_count > MAX_DRY_RUN_STEPS:
            self._error(f"the dry run stopped after {MAX_DRY_RUN_STEPS} steps")
        if seq >= self.max_steps:
            self._refused(
                seq, name, effect, codes.MAX_STEPS_EXCEEDED, f"step {seq} is past max_steps"
            )

    def _count(self, cost: dict[str, int]) -> None:
        for unit, amount in cost.items():
            self.report.cost[unit] = self.report.cost.get(unit, 0) + amount

    def _refused(self, seq: int, name: str, effect: Effect, code: str, message: str) -> NoReturn:
        """The step would fail (a denial, a failed plan): report it, then fail it as a run would."""
        self.report.steps.append(
            DryRunStep(
                seq=seq,
                action=name,
                effect=effect.value,
                summary=message,
                output=None,
                cost={},
                run=self.path,
                error=code,
            )
        )
        raise StepFailed(code, message)

    def ai_task(self, provider: str, request: Any) -> Result:
        """``ctx.ai_task`` in a dry run: no task, no provider call; one ``ai_calls`` unit."""
        if provider not in ai.providers():
            return failed(f"no AI provider {provider!r} is registered", code="UNKNOWN_AI_PROVIDER")
        to_json_value(request, "the AI request")
        self.ai_calls += 1
        return Succeeded({"planned": True, "ai_provider": provider}, f"AI task {provider}")

    def children(self, name: str, inputs: list[Any], *, wait: bool = True) -> Any:
        seq = self.next_seq
        self.next_seq += 1
        self._count_step(seq, f"children:{name}", Effect.PURE)  # a step of the loop budget too
        return self.planned_children(seq, name, inputs, wait=wait)

    def planned_children(
        self, seq: int, name: str, inputs: list[Any], *, wait: bool = False
    ) -> Any:
        """Execute the children of step ``seq`` dry, in order. Without ``wait``: unsaved runs."""
        try:
            inputs = validation.child_inputs(inputs, f"inputs of children step {seq}")
        except InvalidInput as exc:
            self._error(str(exc))
        if self.depth >= MAX_DEPTH:
            self._error(f"children nested deeper than {MAX_DEPTH} levels")
        if len(inputs) > settings.max_children_per_step():
            raise StepFailed(codes.FAN_OUT_EXCEEDED, f"{len(inputs)} children in one step")
        # As in execution, the root's max_steps also bounds the children of the tree.
        self.report.children += len(inputs)
        if self.report.children > self.report.max_children:
            raise StepFailed(
                codes.MAX_STEPS_EXCEEDED,
                f"{self.report.children} children in the tree, over max_steps="
                f"{self.report.max_children} of the root",
            )
        results = []
        for i, child_input in enumerate(inputs):
            path = f"{self.path + '.' if self.path else ''}{seq}[{i}]"
            output, failure = _execute(
                self.report, name, child_input, self.principal, path, self.depth + 1
            )
            results.append(ChildResult("failed" if failure else "succeeded", output, failure or ""))
        if not wait:
            definition = get_workflow(name)
            return [
                WorkflowRun(
                    workflow_name=name,
                    app_id=definition.app_id,
                    input=child_input,
                    status=WorkflowRun.Status.QUEUED,
                    child_index=i,
                    parent_step=seq,
                )
                for i, child_input in enumerate(inputs)
            ]
        return results


def _execute(
    report: DryRunReport, name: str, input: Any, principal: Any, path: str, depth: int
) -> tuple[Any, str | None]:
    from .workflows import RunHandle

    try:
        definition = get_workflow(name)
    except UnknownWorkflow as exc:
        report.errors.append(f"{path or 'root'}: {exc}")
        return None, "DRY_RUN_ERROR"
    execution = _DryExecution(
        report, principal, definition.app_id, path, depth, max_steps=definition.max_steps
    )
    try:
        output = definition.fn(RunHandle(execution), copy.deepcopy(input))
        to_json_value(output, "the workflow's return value")
        return output, None
    except StepFailed as exc:
        return None, exc.code
    except Suspend:
        return None, "DRY_RUN_ERROR"
    except Exception as exc:
        # In execution this is a retry; in a dry run, an error of the report
        # (never an HTTP 500 in the admin, never a traceback in ``manage.py dryrun``).
        report.errors.append(
            f"{path or 'root'}: workflow code raised {type(exc).__name__}: "
            + validation.storable_message(exc)[:500]
        )
        return None, "DRY_RUN_ERROR"


def dry_run(name: str, input: Any, principal: Any = None) -> DryRunReport:
    """Execute workflow ``name`` with ``plan()`` for every effect; report steps, costs, errors."""
    if not isinstance(name, str):
        raise InvalidInput(f"the workflow name must be a string, not {type(name).__name__}")
    definition = get_workflow(name)
    if input is None:
        raise InvalidInput("the workflow input must not be None (use {} for no input)")
    input = to_json_value(input, "the workflow input")
    principal = to_json_value(principal, "the principal")
    budget = dict(definition.effect_budget)
    if definition.max_ai_calls is not None:
        budget[AI_CALLS] = definition.max_ai_calls
    report = DryRunReport(workflow=name, budget=budget, max_children=definition.max_steps)
    output, failure = _execute(report, name, input, principal, "", 0)
    report.output = output
    if failure and failure != "DRY_RUN_ERROR":
        report.failed = failure
    return report
