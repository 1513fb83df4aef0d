"""``check`` and ``check --deploy`` warn while the witness records go nowhere (#35, #47).

Without an INFO handler on ``k2b_workflows.witness`` (or a ``WITNESS_SINK``)
the records of dispatches and ends, the only detection of an owner's rollback,
were dropped and nothing said so. Only ``check --deploy`` said it at first, and
a fresh project, set up with a plain ``check``, witnessed nothing unwarned.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from django.core import checks
from django.test import override_settings

from k2b_workflows.kernel import witness


def deploy_warnings() -> list[str]:
    return [
        m.id
        for m in checks.run_checks(include_deployment_checks=True, tags=[checks.Tags.security])
        if m.id == "k2b_workflows.W040"
    ]


@pytest.fixture
def unheard(monkeypatch) -> Iterator[logging.Logger]:
    """The witness logger as a fresh project leaves it: no handler, only the last resort.

    A logger of its own, outside the test runner's capture (which listens on
    every logger); its parent is the root logger, with no handler either.
    """
    root = logging.RootLogger(logging.WARNING)
    fresh = logging.Logger("k2b_workflows.witness")
    fresh.parent = root
    monkeypatch.setattr(witness, "logger", fresh)
    yield fresh


def test_check_deploy_warns_while_the_witness_goes_nowhere(unheard):
    assert deploy_warnings() == ["k2b_workflows.W040"]


@pytest.mark.parametrize("handler", [logging.NullHandler(), logging.StreamHandler()])
def test_a_handler_that_drops_info_is_nowhere_too(unheard, handler):
    if not isinstance(handler, logging.NullHandler):
        handler.setLevel(logging.WARNING)
    unheard.addHandler(handler)
    assert deploy_warnings() == ["k2b_workflows.W040"]


def test_the_documented_one_line_setup_silences_it(unheard):
    unheard.addHandler(logging.StreamHandler())
    unheard.setLevel(logging.INFO)
    assert deploy_warnings() == []


def test_a_parent_handler_it_propagates_to_counts(unheard):
    assert unheard.parent is not None
    unheard.setLevel(logging.INFO)
    unheard.parent.addHandler(logging.StreamHandler())
    assert deploy_warnings() == []
    unheard.propagate = False
    assert deploy_warnings() == ["k2b_workflows.W040"]


def test_a_witness_sink_counts(unheard, settings):
    with override_settings(K2B_WORKFLOWS={**settings.K2B_WORKFLOWS, "WITNESS_SINK": print}):
        assert deploy_warnings() == []


def plain_warnings() -> list[str]:
    return [m.id for m in checks.run_checks(tags=[checks.Tags.security]) if m.id.endswith("W040")]


def test_a_plain_check_warns_too(unheard):
    assert plain_warnings() == ["k2b_workflows.W040"]


def test_a_plain_check_is_silent_once_the_witness_goes_somewhere(unheard):
    unheard.addHandler(logging.StreamHandler())
    unheard.setLevel(logging.INFO)
    assert plain_warnings() == []


def test_silencing_w040_still_silences_the_plain_checks_warning(unheard, settings):
    settings.SILENCED_SYSTEM_CHECKS = [*settings.SILENCED_SYSTEM_CHECKS, "k2b_workflows.W040"]
    shown = [m for m in checks.run_checks(tags=[checks.Tags.security]) if not m.is_silenced()]
    assert "k2b_workflows.W040" not in [m.id for m in shown]


def test_the_one_line_setup_of_security_md_silences_the_warning():
    import logging.config

    from tests.docs.test_docs import ONE_LINE_WITNESS, evaluate

    shown = evaluate("docs/security.md", ONE_LINE_WITNESS)["LOGGING"]
    log = logging.getLogger("k2b_workflows.witness")
    saved = (log.handlers[:], log.propagate, log.level)
    log.handlers[:] = []
    log.propagate = False  # the test runner's capture, on the root logger, does not count
    try:
        assert deploy_warnings() == ["k2b_workflows.W040"]
        logging.config.dictConfig({**shown, "disable_existing_loggers": False})
        log.propagate = False
        assert deploy_warnings() == []
    finally:
        for attached in log.handlers:
            attached.close()
        log.handlers[:], log.propagate = saved[0], saved[1]
        log.setLevel(saved[2])
