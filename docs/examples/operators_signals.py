"""docs/operators.md, "Being told": page the on-call person when a run needs a decision."""

# --8<-- [start:page_on_call]
# ops/signals.py
from django.dispatch import receiver
from django.urls import reverse

from k2b_workflows.signals import run_needs_attention

from .providers import pager


@receiver(run_needs_attention)
def page_on_call(sender, run_id, workflow_name, error_code, message, step, **kwargs):
    resolve = reverse("admin:k2b_workflows_incident_resolve", args=[run_id])
    pager.trigger(f"{workflow_name} {run_id} needs a decision: {error_code}",
                  link=f"https://ops.example.com{resolve}")
# --8<-- [end:page_on_call]
