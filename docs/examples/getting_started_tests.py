"""docs/getting-started.md, "Test your workflows": a test of the page's checkout."""

# --8<-- [start:test]
import pytest

from k2b_workflows import start_workflow_run
from k2b_workflows.testing import run_until_idle


@pytest.mark.django_db(transaction=True)
def test_checkout_charges_once():
    run = start_workflow_run("shop.checkout", {"sku": "TEA-01", "amount": 2900})
    run_until_idle()
    run.refresh_from_db()
    assert run.status == "succeeded"
# --8<-- [end:test]
