"""What the django.tasks tests share."""

import pytest

from k2b_workflows.models import WorkflowRun


@pytest.fixture
def nothing_inserted():
    """The test inserts no run: a refused call leaves nothing behind."""
    before = WorkflowRun.objects.count()
    yield
    assert WorkflowRun.objects.count() == before
