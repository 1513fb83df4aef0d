"""The names a task run is known by: its workflows, their app, its effects.

Read by code that must not import django.tasks, which a project may not
have: the admin tells a task run from a workflow run by its workflow's
name, and the kernel's readers name a task's step. Nothing here imports
Django, so reading a name never imports the backend (#48). The workflows'
names, and the name a run is shown by (its task's path), are in
``k2b_workflows.naming``, below the models and the kernel that name runs too
(#51).
"""

from __future__ import annotations

from ..naming import (
    EFFECT_NAMES,
    EFFECT_OF_WORKFLOW,
    TASK_WORKFLOW_PREFIX,
    WORKFLOW_NAMES,
    is_task_workflow,
)

__all__ = [
    "EFFECT_NAMES",
    "EFFECT_OF_WORKFLOW",
    "MAX_PATH",
    "PRIORITY_OFFSET",
    "TASK_APP_ID",
    "TASK_WORKFLOW_PREFIX",
    "WORKFLOW_NAMES",
    "is_task_workflow",
]

#: The app id of task runs: ``runworkflows --app tasks`` runs tasks only.
TASK_APP_ID = "tasks"
#: ``Action.name`` is 200 characters; the journal names the step ``task:<path>``.
MAX_PATH = 190
#: Django's priorities (-100..100) on the kernel's scale (0..1000, higher first).
PRIORITY_OFFSET = 100
