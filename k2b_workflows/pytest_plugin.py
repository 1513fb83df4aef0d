"""pytest fixtures for testing workflows built on k2b_workflows.

Opt in from your root ``conftest.py`` (the plugin is not registered by
installing the package, so it never changes a suite that did not ask)::

    pytest_plugins = ["k2b_workflows.pytest_plugin"]

or with ``addopts = -p k2b_workflows.pytest_plugin`` in ``pytest.ini``. Tests
marked ``django_db(transaction=True)`` need neither: the app's ``flush``
command empties the append-only tables on the test database
(``k2b_workflows.testdb``).

Fixtures (each undoes itself at teardown, whatever the test did):

``k2b_clock``
    A ``k2b_workflows.testing.WorkflowClock`` running for the test:
    ``k2b_clock.advance(hours=1)`` makes an hour of retry backoff, wait
    deadlines and leases pass at once, and ``run_until_idle()`` moves it
    instead of sleeping. Use it with pytest-django's ``django_db`` mark
    (plain or ``transaction=True``), as any test of workflows.

``k2b_fast_retries``
    Retry backoff of 1 ms for the test (``testing.fast_retries()``): for
    tests that retry through failures and do not want a clock.

Plain functions are in ``k2b_workflows.testing`` for tests that are not
pytest's, or that need a clock for only part of a test.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from .testing import WorkflowClock


@pytest.fixture
def k2b_clock() -> Iterator[WorkflowClock]:
    """The kernel's clock for this test, moved with ``advance()``; real time again after it."""
    # Imported here: pytest loads this module before Django's app registry is ready.
    from .testing import controlled_clock

    with controlled_clock() as clock:
        yield clock


@pytest.fixture
def k2b_fast_retries() -> Iterator[None]:
    """Retries back off 1 ms instead of ``RETRY_BACKOFF_MS`` during this test."""
    from .testing import fast_retries

    with fast_retries():
        yield
