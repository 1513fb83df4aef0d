"""What the run page shows, computed from the journal, ledger, budget and children.

Kept apart from ``admin.py`` so the admin classes stay declarations, and so
the timeline arithmetic can be read (and tested) on its own.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db.models import JSONField
from django.db.models.expressions import RawSQL
from django.urls import reverse

from .. import codes, settings
from ..control import RESOLVABLE_CODES, count_child_workflow_runs
from ..kernel import clock, flow
from ..models import (
    BudgetAccount,
    BudgetCharge,
    JournalEntry,
    LedgerEntry,
    RunStatus,
    WorkflowRun,
)

#: Ledger kinds that are answers about whether an effect happened.
ANSWER_KINDS = (
    LedgerEntry.Kind.SUCCEEDED,
    LedgerEntry.Kind.FAILED,
    LedgerEntry.Kind.OUTCOME_UNKNOWN,
    LedgerEntry.Kind.RECONCILED,
    LedgerEntry.Kind.RECONCILE_UNKNOWN,
    LedgerEntry.Kind.LATE_RESULT,
    LedgerEntry.Kind.RESOLVED_CONFIRMED,
    LedgerEntry.Kind.RESOLVED_ABSENT,
    LedgerEntry.Kind.REJECTED,
)

#: Smallest bar drawn, in percent of the timeline: a 1 ms step stays visible.
MIN_BAR_PCT = 0.6


@dataclass
class TimelineBar:
    """One step drawn as a bar: where it starts and how long it took, in percent."""

    seq: int
    action: str
    effect: str
    state: str
    css: str
    started_at: datetime
    ended_at: datetime
    offset_pct: float = 0.0
    width_pct: float = 0.0
    stopped: bool = False
    summary: str = ""

    @property
    def duration(self) -> timedelta:
        return self.ended_at - self.started_at

    @property
    def duration_text(self) -> str:
        return format_duration(self.duration)


@dataclass
class Timeline:
    bars: list[TimelineBar]
    started_at: datetime
    ended_at: datetime

    @property
    def total_text(self) -> str:
        return format_duration(self.ended_at - self.started_at)


def format_duration(delta: timedelta) -> str:
    """``"850 ms"``, ``"12.4 s"``, ``"3 min 5 s"``, ``"2 h 10 min"``: readable at a glance."""
    ms = max(0.0, delta.total_seconds() * 1000)
    if ms < 1000:
        return f"{ms:.0f} ms"
    seconds = ms / 1000
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, seconds = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {seconds} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min"


def _open_step_state(run: WorkflowRun) -> tuple[str, str]:
    if run.status == RunStatus.NEEDS_ATTENTION:
        return "needs attention", "attention"
    if run.status == RunStatus.WAITING:
        return f"waiting on {run.wait_kind}", "waiting"
    if run.status == RunStatus.RUNNING:
        return "running", "running"
    if run.status == RunStatus.FAILED:
        return f"failed ({run.error_code})" if run.error_code else "failed", "failed"
    if run.status == RunStatus.CANCELED:
        return "canceled", "canceled"
    return "not finished", "queued"


def build_timeline(
    run: WorkflowRun,
    journal: list[JournalEntry],
    ledger: list[LedgerEntry],
    now: datetime | None = None,
) -> Timeline:
    """One bar per journaled step, plus the step the run stopped in, if any.

    A step starts at its ``started_at`` (or where the previous one ended) and
    ends when its journal entry was written. The step the run stopped in has
    no journal entry: it ends at its last ledger entry (a run that needs
    attention), or now (a run still running or waiting).
    """
    now = now or clock.now()
    bars: list[TimelineBar] = []
    previous_end = run.created_at
    for entry in sorted(journal, key=lambda e: e.seq):
        start = entry.started_at or previous_end
        bars.append(
            TimelineBar(
                seq=entry.seq,
                action=entry.action_name,
                effect=entry.effect,
                state=f"{entry.state} ({entry.error_code})" if entry.error_code else entry.state,
                css=entry.state,
                started_at=start,
                ended_at=max(entry.created_at, start),
                summary=entry.summary,
            )
        )
        previous_end = entry.created_at

    journaled = {entry.seq for entry in journal}
    open_seq = _open_step(run, journaled, ledger)
    if open_seq is not None:
        step_ledger = [e for e in ledger if e.seq == open_seq]
        # The first dispatch is when the effect began; a step with no ledger
        # (PURE, still waiting) began when the previous one ended.
        start = min((e.created_at for e in step_ledger), default=previous_end)
        if run.status in (RunStatus.RUNNING, RunStatus.WAITING, RunStatus.QUEUED):
            end = now
        else:
            end = max(
                [e.created_at for e in step_ledger] + [run.finished_at or run.updated_at, start]
            )
        dispatched = next((e for e in step_ledger if e.kind == LedgerEntry.Kind.DISPATCHED), None)
        state, css = _open_step_state(run)
        bars.append(
            TimelineBar(
                seq=open_seq,
                action=dispatched.action_name if dispatched else "",
                effect=dispatched.effect if dispatched else "",
                state=state,
                css=css,
                started_at=start,
                ended_at=end,
                stopped=True,
            )
        )

    started = run.created_at
    ended = max([b.ended_at for b in bars] + [run.finished_at or started, started])
    span = max((ended - started).total_seconds(), 0.001)
    for bar in bars:
        offset = (bar.started_at - started).total_seconds() / span * 100
        width = bar.duration.total_seconds() / span * 100
        bar.offset_pct = round(min(max(offset, 0.0), 100 - MIN_BAR_PCT), 2)
        bar.width_pct = round(min(max(width, MIN_BAR_PCT), 100 - bar.offset_pct), 2)
    return Timeline(bars=bars, started_at=started, ended_at=ended)


def _open_step(run: WorkflowRun, journaled: set[int], ledger: list[LedgerEntry]) -> int | None:
    """The step the run stopped in (or is in now), when it has no journal entry."""
    if run.status == RunStatus.SUCCEEDED:
        return None
    for candidate in (
        run.attention_step,
        run.wait_step if run.status == "waiting" else None,
        run.current_step,
    ):
        if candidate is not None and candidate not in journaled:
            return candidate
    unjournaled = [e.seq for e in ledger if e.seq is not None and e.seq not in journaled]
    return max(unjournaled) if unjournaled else None


@dataclass
class BudgetLine:
    label: str
    spent: int
    limit: int | None

    @property
    def pct(self) -> float:
        if not self.limit:
            return 0.0
        return round(min(self.spent / self.limit * 100, 100.0), 1)

    @property
    def over(self) -> bool:
        return self.limit is not None and self.spent > self.limit


def budget_lines(account: BudgetAccount | None) -> list[BudgetLine]:
    """Each unit of the root's budget: spent by the whole tree against its limit."""
    if account is None:
        return []
    units = sorted(set(account.effect_budget or {}) | set(account.spent or {}))
    lines = [
        BudgetLine(
            unit, int((account.spent or {}).get(unit, 0)), (account.effect_budget or {}).get(unit)
        )
        for unit in units
    ]
    lines.append(BudgetLine("AI calls", account.ai_calls, account.max_ai_calls))
    lines.append(
        BudgetLine("child runs (count against max steps)", account.children, account.max_steps)
    )
    return lines


def _newest(queryset: Any, order: str, limit: int) -> tuple[list[Any], int]:
    """The newest ``limit`` rows in ascending ``order``, and how many there are in all.

    A run that polled a provider for a week has tens of thousands of ledger
    entries: the page shows the newest (where an incident is) and links to the rest.
    """
    rows = list(queryset.order_by(f"-{order}")[: limit + 1])
    if len(rows) <= limit:
        return rows[::-1], len(rows)
    return rows[:limit][::-1], queryset.count()


def run_page_context(run: WorkflowRun) -> dict[str, Any]:
    """Everything the run page shows below the run's own fields, read in a few queries."""
    limit = settings.admin_run_page_rows()
    # The step outputs are not drawn on the page; they may be large.
    journal, journal_total = _newest(
        JournalEntry.objects.filter(run=run).defer("output"), "seq", limit
    )
    ledger, ledger_total = _newest(LedgerEntry.objects.filter(run=run), "id", limit)
    account = BudgetAccount.objects.filter(root_id=run.root_id or run.id).first()
    children = list(
        WorkflowRun.objects.filter(parent=run)
        .order_by("parent_step", "child_index")
        .only(
            "id",
            "workflow_name",
            "task_path",
            "status",
            "parent_step",
            "child_index",
            "error_code",
        )[:50]
    )
    counts = count_child_workflow_runs(run.id)
    return {
        "timeline": build_timeline(run, journal, ledger),
        "journal": journal,
        "ledger": ledger,
        "journal_total": journal_total,
        "ledger_total": ledger_total,
        "journal_list_url": f"{reverse('admin:k2b_workflows_journalentry_changelist')}?q={run.pk}",
        "ledger_list_url": f"{reverse('admin:k2b_workflows_ledgerentry_changelist')}?q={run.pk}",
        "budget_account": account,
        "budget_lines": budget_lines(account),
        "charges": list(BudgetCharge.objects.filter(run=run).order_by("seq", "unit")),
        "children": children,
        "child_counts": {k: v for k, v in counts.items() if v and k != "total"},
        "child_total": counts.get("total", 0),
        "is_root": run.parent_id is None,
        "queued_reason": flow.why_queued(settings.database(), run),
        "key_url": concurrency_key_url(run.workflow_name, run.concurrency_key)
        if run.concurrency_key is not None
        else "",
    }


def concurrency_key_url(workflow_name: str, key: str) -> str:
    """The per-key page: a key's active runs and the runs queued behind it."""
    from django.utils.http import urlencode

    query = urlencode({"workflow": workflow_name, "key": key})
    return f"{reverse('admin:k2b_workflows_workflowrun_concurrency_key')}?{query}"


def incident_answers(run: WorkflowRun, ledger: list[LedgerEntry]) -> list[LedgerEntry]:
    """The answers so far about the step the incident is about (reconcile, late results)."""
    return [e for e in ledger if e.seq == run.attention_step and e.kind in ANSWER_KINDS]


def incident_dispatch(run: WorkflowRun, ledger: list[LedgerEntry]) -> LedgerEntry | None:
    """The newest dispatch of the step the incident is about: the effect in doubt."""
    dispatches = [
        e for e in ledger if e.seq == run.attention_step and e.kind == LedgerEntry.Kind.DISPATCHED
    ]
    return dispatches[-1] if dispatches else None


# Incidents: what each needs_attention code means and which actions apply -------------------


@dataclass(frozen=True)
class IncidentGuide:
    """What an operator reads on an incident, and the only actions that can change it.

    ``actions`` are among "resolve" (the effect resolution form), "retry" and
    "cancel": a button that could only answer "nothing changed" is never shown.
    """

    title: str
    explain: str
    actions: tuple[str, ...]


_EFFECT_GUIDE = IncidentGuide(
    title="An effect may or may not have happened",
    explain=(
        "The step dispatched an external effect and neither its result nor reconcile() "
        "tells whether it happened. Check with the provider, then record what you found: "
        '"effect confirmed" continues with the output you enter, without calling the '
        'provider again; "effect absent" runs the step again under a new invocation key '
        "and the same effect key. Or cancel the run."
    ),
    actions=("resolve", "cancel"),
)

INCIDENT_GUIDES: dict[str, IncidentGuide] = {
    codes.EFFECT_OUTCOME_UNKNOWN: _EFFECT_GUIDE,
    codes.EFFECT_CONTRADICTED: IncidentGuide(
        title="A late result contradicts what the run was told",
        explain=(
            "The worker that called the provider came back after another worker had taken "
            "the run over and been told the opposite (by reconcile() or by an operator). Both "
            "ledger entries are below: the late result is the provider's own answer to the "
            "call. Check with the provider and record what you found, as for any effect in "
            "doubt. Or cancel the run."
        ),
        actions=("resolve", "cancel"),
    ),
    codes.WORKFLOW_RETRY_EXHAUSTED: IncidentGuide(
        title="Retries ran out while an effect is in doubt",
        explain=(
            "The run failed too many times in a row while an external effect of the step "
            "below was dispatched with no known outcome, so it was not simply failed. "
            "Check with the provider and record what you found, as for any effect in doubt. "
            "Or cancel the run."
        ),
        actions=("resolve", "cancel"),
    ),
    codes.WORKFLOW_NONDETERMINISTIC: IncidentGuide(
        title="The workflow code no longer matches the journal",
        explain=(
            "On replay the workflow asked for another step than the one journaled at this "
            "position (both are shown below). Nothing was executed. Deploy code that asks for "
            "the journaled step again: the old code kept as its own version beside the new "
            'one, or the change wrapped in run.patched("…"). Then retry: the run replays its '
            "journal on the code now running. Or cancel the run."
        ),
        actions=("retry", "cancel"),
    ),
    codes.WORKFLOW_CODE_ERROR: IncidentGuide(
        title="The workflow code raised an exception",
        explain=(
            "The workflow function itself raised (not one of its steps): a bug, which the "
            "same code would raise again, so it was not retried. Deploy a fix, then retry: "
            "journaled steps return their stored output and are not run again. Or cancel "
            "the run."
        ),
        actions=("retry", "cancel"),
    ),
    codes.INTEGRITY_CHAIN_BROKEN: IncidentGuide(
        title="The evidence chain of this run is broken",
        explain=(
            "A journal or ledger row of this run no longer matches its hash chain: it was "
            "changed or deleted outside the kernel. The chain is never bypassed. Restore the "
            "rows from a backup (manage.py verifyworkflows names the break), then retry: the "
            "chain is verified again before any step runs. Or cancel the run."
        ),
        actions=("retry", "cancel"),
    ),
}

_OTHER_GUIDE = IncidentGuide(
    title="The run needs attention",
    explain="The kernel stopped this run for an operator. Cancel it, or leave it for now.",
    actions=("cancel",),
)


def incident_guide(run: WorkflowRun) -> IncidentGuide | None:
    """The guide for a run in ``needs_attention`` (None for any other status)."""
    if run.status != RunStatus.NEEDS_ATTENTION:
        return None
    guide = INCIDENT_GUIDES.get(run.error_code, _OTHER_GUIDE)
    if "resolve" in guide.actions and (
        run.attention_step is None or run.error_code not in RESOLVABLE_CODES
    ):
        # No step in doubt: the resolution form could only refuse.
        return IncidentGuide(guide.title, guide.explain, ("cancel",))
    return guide


@dataclass
class Divergence:
    """Both sides of a nondeterministic replay, as the run page shows them."""

    seq: int
    journaled: dict[str, Any]
    asked: dict[str, Any]


def incident_divergence(run: WorkflowRun) -> Divergence | None:
    detail = run.error_detail or {}
    if run.error_code != codes.WORKFLOW_NONDETERMINISTIC or detail.get("kind") != "nondeterminism":
        return None
    return Divergence(detail["seq"], detail.get("journaled", {}), detail.get("asked", {}))


def incident_traceback(run: WorkflowRun) -> str:
    detail = run.error_detail or {}
    if run.error_code != codes.WORKFLOW_CODE_ERROR:
        return ""
    return str(detail.get("traceback", ""))


# Incidents: the call's arguments and its effect key, as far as the code used one ---------


#: The lists' arguments column (the incident queue, the settle page): a run's input
#: only when it is stored in at most ``INPUT_SHOWN_BYTES`` and is at most
#: ``INPUT_SHOWN_CHARS`` as text. ``pg_column_size`` reads the stored value's header,
#: not the value, so a list of runs with 10 MB inputs reads none of them; a CASE tests
#: in order, so only a value stored small is measured as text (a compressed one may be
#: far larger).
INPUT_SHOWN_BYTES = 4096
INPUT_SHOWN_CHARS = 16384
BOUNDED_INPUT_SQL = (
    'CASE WHEN pg_column_size("k2b_run"."input") > %s THEN NULL'
    ' WHEN octet_length("k2b_run"."input"::text) > %s THEN NULL'
    ' ELSE "k2b_run"."input" END'
)


def bounded_input() -> RawSQL:
    """The run's input as ``call_input`` where it is small, else NULL (see above)."""
    return RawSQL(
        BOUNDED_INPUT_SQL, [INPUT_SHOWN_BYTES, INPUT_SHOWN_CHARS], output_field=JSONField()
    )


def call_arguments(run: WorkflowRun, input: Any = None) -> Any:
    """What the call was made with: a task call's arguments, a workflow run's input.

    ``input``: the run's input when it was read apart (the incident queue reads
    it bounded); else ``run.input``. Shown through ``pretty_json``, so redacted
    as every run's input is.
    """
    if input is None:
        input = run.input
    if run.task_path and isinstance(input, dict):
        return {"args": input.get("args", []), "kwargs": input.get("kwargs", {})}
    return input


@dataclass(frozen=True)
class EffectKeyShown:
    """Whether the provider can have been given the effect key, and what to say of it.

    ``used``: True for a workflow action (its step context carries the key it
    passes), False for a task that takes no context (it cannot read
    ``effect_key(context)``), None when the rows and the code at hand cannot tell.
    """

    used: bool | None
    note: str


def effect_key_shown(run: WorkflowRun) -> EffectKeyShown:
    """Whether the incident's effect key is one the provider may know the effect by."""
    if not run.task_path:
        return EffectKeyShown(True, "what the provider knows this effect by")
    takes_context = _task_takes_context(run.task_path)
    if takes_context is False:
        return EffectKeyShown(
            False,
            "none: this task takes no context, so it cannot have passed effect_key(context) "
            "to the provider; the provider knows this call by its arguments only",
        )
    if takes_context is None:
        return EffectKeyShown(
            None,
            "unknown whether the provider saw it: the task's code is not loaded in this process",
        )
    return EffectKeyShown(
        None,
        "what effect_key(context) returned to the task, if it passed it to the provider "
        "(the rows do not record whether it did)",
    )


def _task_takes_context(path: str) -> bool | None:
    """Whether the task at ``path`` takes a context, from the modules already imported.

    Never imports: the path comes from a row, and an admin page must not run a
    module's import-time code because a row names it. None: not loaded here.
    """
    module_name, _, attr = path.rpartition(".")
    task = getattr(sys.modules.get(module_name), attr, None)
    if task is None or getattr(task, "module_path", None) != path:
        return None
    return bool(getattr(task, "takes_context", False))
