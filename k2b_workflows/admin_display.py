"""What the run page shows, computed from the journal, ledger, budget and children.

Kept apart from ``admin.py`` so the admin classes stay declarations, and so
the timeline arithmetic can be read (and tested) on its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.urls import reverse
from django.utils import timezone

from . import store
from .control import count_child_workflow_runs
from .models import (
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
    now = now or timezone.now()
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
    limit = store.admin_run_page_rows()
    # The step outputs are not drawn on the page; they may be large.
    journal, journal_total = _newest(
        JournalEntry.objects.filter(run=run).defer("output"), "seq", limit
    )
    ledger, ledger_total = _newest(LedgerEntry.objects.filter(run=run), "id", limit)
    account = BudgetAccount.objects.filter(root_id=run.root_id or run.id).first()
    children = list(
        WorkflowRun.objects.filter(parent=run)
        .order_by("parent_step", "child_index")
        .only("id", "workflow_name", "status", "parent_step", "child_index", "error_code")[:50]
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
    }


def incident_answers(run: WorkflowRun, ledger: list[LedgerEntry]) -> list[LedgerEntry]:
    """The answers so far about the step the incident is about (reconcile, late results)."""
    return [e for e in ledger if e.seq == run.attention_step and e.kind in ANSWER_KINDS]


def incident_dispatch(run: WorkflowRun, ledger: list[LedgerEntry]) -> LedgerEntry | None:
    """The newest dispatch of the step the incident is about: the effect in doubt."""
    dispatches = [
        e for e in ledger if e.seq == run.attention_step and e.kind == LedgerEntry.Kind.DISPATCHED
    ]
    return dispatches[-1] if dispatches else None
