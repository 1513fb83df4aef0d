"""Tasks whose calls take turns by tenant (``Fairness``, #50).

Declared in tests/settings.py (``OPTIONS["tasks"]``), which every Django the
suite runs on reads: Django 6.0's ``@task`` takes no ``fairness=``.
``declared_on_task`` says it on the task itself, where ``@task`` takes it.
"""

from __future__ import annotations

from k2b_workflows import Fairness
from tests.tasks_app.tasks import EXTRA_ARGUMENTS, task


@task()
def tenant_job(tenant_id, n=0):
    return [tenant_id, n]


@task()
def any_keywords(**kwargs):
    return sorted(kwargs)


if EXTRA_ARGUMENTS:

    @task(fairness=Fairness(key="account", weights={"big": 2}))
    def declared_on_task(account):
        return account
