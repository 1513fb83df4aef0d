"""The names a task run is known by: its workflows, their app, its effects.

Read by code that must not import django.tasks, which a project may not
have: the admin tells a task run from a workflow run by its workflow's
name, and the kernel's readers name a task's step. Nothing here imports
Django, so reading a name never imports the backend (#48).
"""

from __future__ import annotations

#: The app id of task runs: ``runworkflows --app tasks`` runs tasks only.
TASK_APP_ID = "tasks"
#: The effects a task may declare, in the order error messages list them.
EFFECT_NAMES = ("pure", "idempotent", "external")
#: Every task workflow's name starts so: ``k2b.task.<effect>``.
TASK_WORKFLOW_PREFIX = "k2b.task."
WORKFLOW_NAMES = {effect: f"{TASK_WORKFLOW_PREFIX}{effect}" for effect in EFFECT_NAMES}
EFFECT_OF_WORKFLOW = {name: effect for effect, name in WORKFLOW_NAMES.items()}
#: ``Action.name`` is 200 characters; the journal names the step ``task:<path>``.
MAX_PATH = 190
#: Django's priorities (-100..100) on the kernel's scale (0..1000, higher first).
PRIORITY_OFFSET = 100


def is_task_workflow(workflow_name: str) -> bool:
    """Whether runs of ``workflow_name`` are django.tasks task calls."""
    return workflow_name.startswith(TASK_WORKFLOW_PREFIX)
