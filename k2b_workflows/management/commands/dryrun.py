"""``manage.py dryrun NAME --input JSON [--principal JSON]``: what a run would do, as a table.

Runs ``dry_run()``: ``plan()`` in place of every effect, ``cost()`` and
``authorize()`` as in execution, nothing written. Prints the steps with their
summaries and costs, the totals against the budget and the errors. Exits
non-zero when the report has errors, a step would fail, or the cost is over
budget, so it can gate a deploy script.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from k2b_workflows.dryrun import DryRunReport, dry_run
from k2b_workflows.exceptions import InvalidInput, UnknownWorkflow
from k2b_workflows.management import arguments


def _cost(cost: dict[str, int]) -> str:
    return ", ".join(f"{unit}={amount}" for unit, amount in sorted(cost.items())) or "-"


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    # Names, summaries and errors come from users and providers: never raw to a terminal.
    rows = [[arguments.printable(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

    return [line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)]


def render(report: DryRunReport) -> list[str]:
    """The report as lines of text: steps, totals against the budget, errors, verdict."""
    lines = [f"Dry run of {arguments.printable(report.workflow)}", ""]
    steps = [
        [s.run or "root", str(s.seq), s.action, s.effect, _cost(s.cost), s.summary, s.error]
        for s in report.steps
    ]
    if steps:
        lines += _table(["run", "step", "action", "effect", "cost", "summary", "error"], steps)
    else:
        lines.append("(no steps)")
    units = sorted(set(report.cost) | set(report.budget))
    if units:
        rows = []
        for unit in units:
            spent, limit = report.cost.get(unit, 0), report.budget.get(unit)
            verdict = "-" if limit is None else ("ok" if spent <= limit else "OVER BUDGET")
            rows.append([unit, str(spent), "-" if limit is None else str(limit), verdict])
        lines += ["", *_table(["unit", "cost", "budget", ""], rows)]
    if report.errors:
        lines += ["", "Errors:", *(f"  {arguments.printable(error)}" for error in report.errors)]
    if report.failed:
        lines += ["", f"The run would fail with {report.failed}."]
    lines += ["", "OK" if report.ok else "NOT OK"]
    return lines


class Command(BaseCommand):
    help = "Dry-run a workflow: plan() for every effect, costs against the budget, nothing written."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name", help="the workflow's registered name")
        parser.add_argument("--input", default="{}", help="the workflow input as JSON")
        parser.add_argument(
            "--principal",
            default=None,
            help="the access context as JSON, as given to start_workflow_run",
        )

    def handle(
        self, *args: Any, name: str, input: str, principal: str | None, **options: Any
    ) -> None:
        value = arguments.json_value(input, "--input")
        who = arguments.json_value(principal, "--principal") if principal is not None else None
        try:
            report = dry_run(name, value, principal=who)
        except (UnknownWorkflow, InvalidInput) as exc:
            raise CommandError(arguments.printable(exc)) from None
        self.stdout.write("\n".join(render(report)))
        if not report.ok:
            problems = []
            if report.errors:
                problems.append(f"{len(report.errors)} error(s)")
            if report.failed:
                problems.append(f"would fail with {report.failed}")
            if not report.within_budget:
                problems.append("over budget")
            raise CommandError(
                f"dry run of {arguments.printable(name)}: {', '.join(problems)}", returncode=1
            )
