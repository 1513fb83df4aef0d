"""docs/tasks.md: plain django.tasks tasks on k2b_workflows, one per effect."""

from datetime import timedelta

from django.db import transaction

from k2b_workflows import Fairness, Retry, Schedule, Unique, progress_of, set_progress
from k2b_workflows.tasks import (
    InvalidTaskCall,
    batch_status,
    effect_key,
    enqueue_batch,
    enqueue_many,
    schedule_task,
)

from .providers import gateway

try:
    from django.tasks import TaskContext, task
except ImportError:  # Django 5.2 with the django-tasks backport
    from django_tasks import TaskContext, task


# --8<-- [start:tasks]
@task(effect="pure")
def render_invoice(order_id, lines):
    # Pure: a crash while it runs runs it again. No effect outside.
    return {"order": order_id, "total": sum(line["amount"] for line in lines)}


@task(takes_context=True, effect="idempotent", retry=Retry(max_attempts=5))
def charge(context: TaskContext, order_id, amount):
    # Idempotent: after a crash it runs again with the same effect_key(context),
    # which the provider uses to charge once.
    made = gateway.charge(amount, idempotency_key=effect_key(context))
    return {"order": order_id, "charge": made.id}


@task(priority=10, queue_name="mail")
def send_receipt(order_id, to):
    # No effect declared: the backend's OPTIONS["effect"], else "external". A
    # crash after it started never sends again: an operator decides.
    return {"sent_to": to, "order": order_id}
# --8<-- [end:tasks]


# --8<-- [start:enqueue]
def place_order(order_id, amount, email):
    with transaction.atomic():
        # ... save the order ...
        charged = charge.enqueue(order_id, amount)  # in this transaction
        send_receipt.enqueue(order_id, email)
    # Nothing is enqueued if the block raised; no worker sees either task before here.
    return charged.id
# --8<-- [end:enqueue]


# --8<-- [start:many]
def invoice_all(orders):
    # One transaction, a few statements for thousands of calls.
    return enqueue_many(render_invoice, [((o["id"], o["lines"]), None) for o in orders])
# --8<-- [end:many]


# --8<-- [start:unique]
@task(effect="pure", unique=Unique(keys=("site_id",), period=timedelta(minutes=10)))
def rebuild_index(site_id, verbose=False):
    # At most one rebuild per site waiting or running, enqueued in the last ten
    # minutes: a second call returns the first call's result (the same id).
    return {"site": site_id}


@task(effect="pure", unique=Unique(keys=("user_id",), debounce=timedelta(seconds=30)))
def sync_profile(user_id, fields):
    # Thirty seconds after the last edit, with the last edit's fields.
    return {"user": user_id, "fields": fields}
# --8<-- [end:unique]


# --8<-- [start:fairness]
@task(effect="pure", fairness=Fairness(key="tenant_id", weights={"enterprise": 3}))
def export_report(tenant_id, report):
    # One tenant's 10,000 exports do not delay another tenant's first one: the
    # tenants' calls take turns, and an "enterprise" tenant gets three to one.
    return {"tenant": tenant_id, "report": report}
# --8<-- [end:fairness]


# --8<-- [start:batch]
@task(effect="idempotent")
def invoices_mailed(batch_id):
    # Called once, when every invoice of the batch has finished (succeeded or failed).
    status = batch_status(batch_id)
    return {"invoiced": status.successful, "failed": status.failed}


@task(effect="idempotent")
def invoices_failed(batch_id):
    # Called once, after invoices_mailed, if one invoice at least failed.
    return {"alert": batch_id}


def invoice_all_then_report(orders):
    batch = enqueue_batch(
        render_invoice,
        [((o["id"], o["lines"]), None) for o in orders],
        on_finish=invoices_mailed,
        on_failure=invoices_failed,
    )
    return batch.id  # batch_status(batch.id) from any process
# --8<-- [end:batch]


# --8<-- [start:schedule]
def schedule_nightly_invoices():
    return schedule_task(
        "nightly-invoice-42",
        render_invoice,
        Schedule(every=timedelta(days=1)),
        args=(42, [{"amount": 100}]),
    )
# --8<-- [end:schedule]


# --8<-- [start:budget]
def payout_cost(partner_id, amount):
    # What one call charges, from the call's arguments (never its context): priced
    # at the enqueue, and on the worker before the task is called.
    return {"cents": amount}


@task(takes_context=True, effect="idempotent", effect_budget={"cents": 50_000}, cost=payout_cost)
def pay_out(context: TaskContext, partner_id, amount):
    # Never more than 500.00 in one call, whatever its arguments say.
    made = gateway.charge(amount, idempotency_key=effect_key(context))
    return {"partner": partner_id, "payout": made.id}


def pay_partner(partner_id, amount):
    try:
        return pay_out.enqueue(partner_id, amount).id
    except InvalidTaskCall:
        return None  # over 500.00: refused, nothing enqueued
# --8<-- [end:budget]


# --8<-- [start:reconcile]
from k2b_workflows import failed, succeeded  # noqa: E402


def find_charge(context: TaskContext, order_id, amount):
    """Did the call under this key happen? Asked on a worker, with the call's arguments,
    when a crash left it unknown."""
    made = gateway.find(idempotency_key=effect_key(context))
    if made is not None:
        return succeeded({"order": order_id, "charge": made.id})  # SUCCESSFUL, this value
    # The gateway deduplicates by the key: calling again is safe, so "not found" may
    # say "call it again". A lookup that can lag, with no dedup, returns unknown(...).
    return failed("no charge under this key", retryable=True)


@task(takes_context=True, effect="external", reconcile=find_charge)
def charge_once(context: TaskContext, order_id, amount):
    made = gateway.charge(amount, idempotency_key=effect_key(context))
    return {"order": order_id, "charge": made.id}
# --8<-- [end:reconcile]


# --8<-- [start:attempts]
FEEDS = {"https://example.com/feed": ["first post"]}


def slower_each_time(exception, task_result):
    if isinstance(exception, PermissionError):
        return None  # no more attempts
    return 2**task_result.attempts  # seconds before the next one


@task(effect="pure", max_attempts=5, backoff=slower_each_time, timeout=30)
def fetch_feed(url):
    if url.startswith("http://"):
        raise PermissionError(f"{url}: plain HTTP is refused")
    if url not in FEEDS:
        raise ConnectionError(f"{url} did not answer")
    return FEEDS[url]


# --8<-- [end:attempts]


# --8<-- [start:progress]
@task(takes_context=True, effect="pure")
def reindex(context: TaskContext, document_ids):
    for done, document_id in enumerate(document_ids, start=1):
        ...  # index one document
        # As often as you like: a few writes a second reach the database, the last always.
        set_progress(context, done, len(document_ids), note=f"document {document_id}")
    return len(document_ids)


def how_far(result_id):
    progress = progress_of(result_id)  # None until the task first reports
    return None if progress is None else f"{progress.done}/{progress.total} {progress.note}"
# --8<-- [end:progress]


# --8<-- [start:cancel]
from k2b_workflows.tasks import cancel, is_cancel_requested  # noqa: E402


@task(takes_context=True, effect="pure")
def reindex_site(context: TaskContext, site_id, pages):
    indexed = []
    for page in pages:
        if is_cancel_requested(context):
            break  # asked to stop: what is done stays done, and is the result
        indexed.append(page)  # index the page
    return {"indexed": len(indexed)}


def stop_reindex(result_id):
    """Not started: it never runs. Running: it is asked, and ends as it answers."""
    return cancel(result_id, reason="the site was deleted")
# --8<-- [end:cancel]
