"""``manage.py demo``: start the demo shop's workflows, run real workers until they settle,
print what happened and where to look in the admin."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand
from django.db.models import Count, Q
from django.urls import reverse

from k2b_workflows import cancel_workflow_run, start_workflow_run, wake_workflow_runs_waiting_on
from k2b_workflows.models import JournalEntry, LedgerEntry, WorkflowRun
from k2b_workflows.signals import run_needs_attention
from k2b_workflows.worker import Worker

from ...models import Approval, OutboxEmail, Payment, Shipment

ORDERS = [
    {"sku": "TEA-01", "items": ["teapot"], "amount_cents": 2_900},
    {"sku": "CUP-06", "items": ["cup", "cup", "saucer"], "amount_cents": 4_800},
    {"sku": "KETTLE", "items": ["kettle"], "amount_cents": 6_900, "simulate_timeout": True},
    {"sku": "SET-XL", "items": ["teapot", "cups", "tray"], "amount_cents": 72_000},
    {"sku": "SET-XXL", "items": ["samovar", "cups"], "amount_cents": 99_000},
]


class Command(BaseCommand):
    help = "Run the demo workflows with real workers and print where to look in the admin."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--concurrency", type=int, default=4)
        parser.add_argument("--timeout", type=float, default=60.0)
        parser.add_argument(
            "--log-file",
            type=Path,
            default=Path(settings.BASE_DIR) / "demo.log",
            help="where the workers' event lines go (default: demo.log beside manage.py)",
        )

    def handle(
        self, *args: Any, concurrency: int, timeout: float, log_file: Path, **options: Any
    ) -> None:
        with _logging_to(log_file):
            self._demo(concurrency, timeout)
        self.stdout.write("")
        self.stdout.write(
            f"The workers' log (every claim, step and ledger entry): {log_file.resolve()}"
        )
        for line in (
            "This demo connects as one database role, the tables' owner: the check that warns",
            "about it (k2b_workflows.W003) is silenced in example_project/settings.py. In",
            "production web and workers connect as a runtime role that cannot rewrite the",
            "evidence (docs/security.md, 'Two database roles').",
        ):
            self.stdout.write(line)

    def _demo(self, concurrency: int, timeout: float) -> None:
        batch = uuid.uuid4().hex[:6]
        self._last_settled = -1
        self._ensure_admin()
        runs: dict[str, WorkflowRun] = {}
        for i, order in enumerate(ORDERS):
            runs[f"checkout {order['sku']}"] = start_workflow_run(
                "shop.checkout",
                {**order, "customer": f"customer{i}@example.com"},
                idempotency_key=f"demo-{batch}-{i}",
                principal={"user": "demo", "roles": ["shop"]},
            )
        runs["bank payout"] = start_workflow_run(
            "shop.payout", {"amount_cents": 12_500}, idempotency_key=f"demo-{batch}-payout"
        )
        doomed = start_workflow_run(
            "shop.checkout",
            {**ORDERS[0], "customer": "late@example.com"},
            idempotency_key=f"demo-{batch}-canceled",
        )
        runs["checkout canceled"] = doomed
        cancel_workflow_run(doomed.pk, "customer changed their mind")

        self.stdout.write(f"Started {len(runs)} runs; running {concurrency} worker threads…")

        def page_on_call(
            sender: Any, run_id: Any, workflow_name: str, error_code: str, **kwargs: Any
        ) -> None:
            # What a team would send to its pager: the run needs a person.
            self.stdout.write(
                f"  PAGE on-call: {workflow_name} {run_id} needs a decision ({error_code})"
            )

        run_needs_attention.connect(page_on_call, weak=False)
        worker = Worker(concurrency=concurrency)
        thread = threading.Thread(target=worker.run, name="demo-worker")
        thread.start()
        try:
            self._approve_large_orders(runs, timeout)
            self._wait_until_settled(runs, timeout)
        finally:
            worker.stop()
            thread.join()
            run_needs_attention.disconnect(page_on_call)
        self._report(runs, worker)

    def _ensure_admin(self) -> None:
        User = get_user_model()
        if not User.objects.filter(username="admin").exists():
            User.objects.create_superuser("admin", "admin@example.com", "admin")
            self.stdout.write("Created the superuser admin / admin for the local admin.")

    def _approve_large_orders(self, runs: dict[str, WorkflowRun], timeout: float) -> None:
        """Play the person approving large orders: a row, then a wake, as a webhook would."""
        deadline = time.monotonic() + timeout
        pending = {r.pk for r in runs.values() if r.workflow_name == "shop.checkout"}
        while pending and time.monotonic() < deadline:
            for run in WorkflowRun.objects.filter(
                pk__in=pending, status="waiting", wait_kind="approval"
            ):
                order_id = int(run.wait_key.removeprefix("order-"))
                Approval.objects.get_or_create(
                    order_id=order_id, defaults={"approved_by": "manager@example.com"}
                )
                wake_workflow_runs_waiting_on(app_id="shop", kind="approval", key=run.wait_key)
                self.stdout.write(f"  approved order {order_id} (woke run {run.pk})")
                pending.discard(run.pk)
            pending -= set(
                WorkflowRun.objects.filter(
                    pk__in=pending,
                    status__in=["succeeded", "failed", "canceled", "needs_attention"],
                ).values_list("pk", flat=True)
            )
            time.sleep(0.1)

    def _wait_until_settled(self, runs: dict[str, WorkflowRun], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        ids = [r.pk for r in runs.values()]
        while time.monotonic() < deadline:
            open_runs = WorkflowRun.objects.filter(
                pk__in=ids, status__in=["queued", "running", "waiting"]
            ).count()
            self._progress(len(ids) - open_runs, len(ids))
            if not open_runs:
                return
            time.sleep(0.1)
        self.stderr.write("Some runs did not settle within the timeout; see the admin.")

    def _progress(self, settled: int, total: int) -> None:
        """A progress bar on a terminal; elsewhere a line each time a run settles."""
        if settled == self._last_settled:
            return
        self._last_settled = settled
        width = 30
        filled = width * settled // total
        bar = f"[{'#' * filled}{'.' * (width - filled)}] {settled}/{total} runs settled"
        if self.stdout.isatty():
            self.stdout.write("\r" + bar, ending="\n" if settled == total else "")
            self.stdout.flush()
        else:
            self.stdout.write("  " + bar)

    def _report(self, runs: dict[str, WorkflowRun], worker: Worker) -> None:
        w = self.stdout.write
        w("")
        w(f"{'run':<22} {'status':<16} {'steps':>5}  result")
        for label, run in runs.items():
            run.refresh_from_db()
            steps = JournalEntry.objects.filter(run=run).count()
            result = run.output if run.status == "succeeded" else run.error_code
            if isinstance(result, dict):
                result = ", ".join(f"{k}={v}" for k, v in result.items() if k != "summary")
            doubts = LedgerEntry.objects.filter(run=run, kind="outcome_unknown").count()
            note = (
                "  (provider timed out; reconciled by key)"
                if doubts and (run.status == "succeeded")
                else ""
            )
            w(f"{label:<22} {run.status:<16} {steps:>5}  {result or ''}{note}")
        ids = [r.pk for r in runs.values()]
        children = WorkflowRun.objects.filter(parent__in=ids)
        w(f"{'  child runs':<22} {dict(children.values_list('status').annotate(n=Count('id')))}")
        keys = Q()
        for run_id in [*ids, *children.values_list("pk", flat=True)]:
            keys |= Q(key__startswith=str(run_id))
        payments = Payment.objects.filter(
            **{"idempotency_key__in": [f"{r.pk}:2" for r in runs.values()]}
        )
        w("")
        w("Effects on the simulated providers, for this demo's runs:")
        w(
            f"  card charges {payments.count()},"
            f" receipts {OutboxEmail.objects.filter(keys).count()},"
            f" shipments {Shipment.objects.filter(keys).count()}"
        )
        w(
            f"  ledger entries {LedgerEntry.objects.filter(run__in=ids).count()}; "
            f"worker: {dict(worker.stats)}"
        )
        statuses = Counter(WorkflowRun.objects.filter(pk__in=ids).values_list("status", flat=True))
        w("")
        w("Runs by status: " + ", ".join(f"{s} {n}" for s, n in sorted(statuses.items())))
        incidents = WorkflowRun.objects.filter(pk__in=ids, status="needs_attention")
        w("")
        w(f"Incidents waiting for an operator: {incidents.count()}")
        site = "http://127.0.0.1:8000"
        for run in incidents[:5]:
            w(f"  {run.workflow_name} {run.pk}: {run.error_code} — {run.error_message}")
            resolve = reverse("admin:k2b_workflows_incident_resolve", args=[run.pk])
            w(f"    resolve it: {site}{resolve}")
        w("")
        w("Where to look: start the admin with  make serve  and open")
        w(
            f"  {site}{reverse('admin:k2b_workflows_workflowrun_changelist')}"
            "   every run, its journal timeline and evidence ledger"
        )
        w(
            f"  {site}{reverse('admin:k2b_workflows_incident_changelist')}"
            "      the incident queue: resolve the bank payout with evidence"
        )
        w("Log in as admin / admin (created for this local demo).")


@contextlib.contextmanager
def _logging_to(path: Path) -> Iterator[None]:
    """Send the kernel's log lines to ``path`` while the demo runs, not into its progress bar.

    Each run logs a line per claim, step and ledger entry: a few hundred lines
    that buried the demo's own output when they went to the terminal.
    """
    logger = logging.getLogger("k2b_workflows")
    saved = (logger.handlers[:], logger.propagate, logger.level)
    handler = logging.FileHandler(path, mode="w", encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.handlers[:], logger.propagate, _ = saved
        logger.setLevel(saved[2])
        handler.close()
