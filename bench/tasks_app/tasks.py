"""The task every engine of ``compare.py --tasks`` runs: a no-op, so that what is measured
is the engine (enqueue, claim, run, record the result), not the task."""

try:
    from django.tasks import task
except ImportError:  # Django 5.2: the backport
    from django_tasks import task  # type: ignore[no-redef]


@task()
def noop(n):
    return n


@task()
def batch_done(batch_id):
    """The callback of ``bench/batches.py``'s batches: a no-op too."""
    return batch_id
