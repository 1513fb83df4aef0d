"""A task module as a bad deploy leaves it on one worker (``K2B_TEST_TASKS_BROKEN``) (#37).

``import``: the module raises on import. ``renamed``: the task was renamed, its
old path names nothing. ``swapped``: the old name now holds another function's
task. The test process imports it intact and enqueues ``fragile``.
"""

from __future__ import annotations

import os

from tests.models import ProviderCall

from .tasks import declared

BROKEN = os.environ.get("K2B_TEST_TASKS_BROKEN", "")

if BROKEN == "import":
    raise ImportError("this worker's copy of the module is broken")


def impostor(n):
    ProviderCall.objects.create(action="task.impostor", payload={"n": n})
    return -n


if BROKEN == "renamed":

    @declared("external")
    def fragile_renamed(n):
        ProviderCall.objects.create(action="task.fragile", payload={"n": n})
        return n

elif BROKEN == "swapped":
    fragile = declared("external")(impostor)

else:

    @declared("external")
    def fragile(n):
        ProviderCall.objects.create(action="task.fragile", payload={"n": n})
        return n
