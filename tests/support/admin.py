"""Operators in the test client: users with permissions, their logged-in clients, incidents to
resolve, and the admin URLs the tests visit."""

from __future__ import annotations

from django.contrib.auth.models import Permission, User
from django.test import Client
from django.urls import reverse

from k2b_workflows import start_workflow_run
from k2b_workflows.models import LedgerEntry, WorkflowRun
from k2b_workflows.testing import run_until_idle

OPERATOR_PERMS = ("view_workflowrun", "resolve_effect")


def make_user(username: str, *codenames: str, superuser: bool = False) -> User:
    if superuser:
        return User.objects.create_superuser(username, f"{username}@example.com", "pw")
    user = User.objects.create_user(username, password="pw", is_staff=True)
    user.user_permissions.add(
        *Permission.objects.filter(content_type__app_label="k2b_workflows", codename__in=codenames)
    )
    return User.objects.get(pk=user.pk)


def client_for(user: User) -> Client:
    client = Client()
    client.force_login(user)
    return client


def make_incident() -> WorkflowRun:
    run = start_workflow_run("test.charge_blind", {"behaviour": "ambiguous"})
    run_until_idle()
    run.refresh_from_db()
    assert run.status == "needs_attention"
    return run


def run_url(run: WorkflowRun) -> str:
    return reverse("admin:k2b_workflows_workflowrun_change", args=[run.pk])


def resolve_url(run: WorkflowRun) -> str:
    return reverse("admin:k2b_workflows_incident_resolve", args=[run.pk])


def head_ledger_id(run: WorkflowRun) -> int:
    return LedgerEntry.objects.filter(run=run).order_by("-id").values_list("id", flat=True)[0]


def resolution_data(run: WorkflowRun, decision: str, **extra: str) -> dict[str, str]:
    data = {
        "decision": decision,
        "evidence": "Provider dashboard: no charge for this effect key.",
        "output": "",
        "seen_ledger_id": str(head_ledger_id(run)),
        "step": str(run.attention_step),
    }
    data.update(extra)
    return data


def messages_of(response) -> list[str]:
    return [str(m) for m in response.context["messages"]] if response.context else []


def user_with(*codenames: str, name: str = "op") -> User:
    user = User.objects.create_user(name, password="x")
    for codename in codenames:
        user.user_permissions.add(
            Permission.objects.get(codename=codename, content_type__app_label="k2b_workflows")
        )
    return User.objects.get(pk=user.pk)  # a fresh object: permissions are cached
