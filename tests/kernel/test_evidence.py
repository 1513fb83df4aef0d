"""Evidence that holds up in an audit (#9): each attack on the ledger is refused or detected.

The attacker here has the owner's powers (``pgtrigger.ignore``, raw SQL) but
not the evidence key: that is what a leaked database password gives. What a
runtime role cannot do at all is in ``test_roles.py``.
"""

from __future__ import annotations

import hashlib
import importlib
import io
import json
from types import SimpleNamespace

import pgtrigger
import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import DatabaseError, connection, transaction
from django.test import Client, override_settings
from django.urls import reverse

from k2b_workflows import (
    EFFECT_CONFIRMED,
    resolve_effect,
    start_workflow_run,
    wake_workflow_runs_waiting_on,
)
from k2b_workflows.kernel import evidence
from k2b_workflows.models import JournalEntry, LedgerEntry, WorkflowRun
from k2b_workflows.store import INTEGRITY_CHAIN_BROKEN
from k2b_workflows.validation import canonical_json
from tests.models import DomainRow, ProviderCall
from tests.support.kernel import describe, fresh, journal, run_to_end

pytestmark = pytest.mark.django_db(transaction=True)

_APPEND_ONLY = (
    "k2b_workflows.JournalEntry:journal_append_only",
    "k2b_workflows.LedgerEntry:ledger_append_only",
)


def _wake(key: str) -> None:
    DomainRow.objects.create(key=key)
    wake_workflow_runs_waiting_on(app_id="tests", kind="signal", key=key)


def _parked(name: str, **input) -> WorkflowRun:
    run = start_workflow_run(name, input)
    run_to_end()
    assert fresh(run).status == "waiting", describe(run)
    return run


def _recompute_unkeyed_journal(run: WorkflowRun) -> None:
    """What an attacker without the key does after editing: rebuild the chain with SHA-256."""
    prev = evidence.GENESIS
    for entry in journal(run):
        entry.key_id = ""
        entry.prev_hash = prev
        entry.entry_hash = evidence.journal_hash(prev, entry, None)
        JournalEntry.objects.filter(pk=entry.pk).update(
            key_id="", prev_hash=prev, entry_hash=entry.entry_hash
        )
        prev = entry.entry_hash


def _stopped_for_integrity(run: WorkflowRun) -> str:
    state = describe(run)
    assert (state["status"], state["code"]) == ("needs_attention", INTEGRITY_CHAIN_BROKEN), state
    return state["message"]


# -- TRUNCATE ---------------------------------------------------------------------------


@pytest.mark.parametrize("table", ["k2b_journal", "k2b_ledger", "k2b_budget_charge"])
def test_truncate_of_an_append_only_table_is_refused_even_for_the_owner(table):
    start_workflow_run("test.charge", {"amount": 3})
    run_to_end()
    with (
        pytest.raises(DatabaseError, match="TRUNCATE is refused"),
        transaction.atomic(),
        connection.cursor() as cursor,
    ):
        cursor.execute(f"TRUNCATE {table} CASCADE")


def test_truncate_then_wake_charges_the_provider_once():
    run = _parked("integrity.charge_then_wait", amount=7, key="t1")
    with pytest.raises(DatabaseError), transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("TRUNCATE k2b_journal, k2b_ledger, k2b_budget_charge")
    _wake("t1")
    run_to_end()
    assert fresh(run).status == "succeeded", describe(run)
    assert ProviderCall.objects.filter(action="test.charge").count() == 1


# -- edited entries ---------------------------------------------------------------------


def test_an_edited_step_output_with_a_recomputed_unkeyed_chain_stops_before_the_next_step():
    run = _parked("integrity.quote_then_charge", amount=5, key="q1")
    with pgtrigger.ignore(*_APPEND_ONLY):
        JournalEntry.objects.filter(run=run, seq=0).update(output={"sum": 999})
        _recompute_unkeyed_journal(run)
    _wake("q1")
    run_to_end()
    message = _stopped_for_integrity(run)
    assert "journal" in message
    # The charge fed by the edited output never ran: not for 999, not at all.
    assert not ProviderCall.objects.filter(action="test.charge").exists()
    assert [e.seq for e in journal(run)] == [0]


def test_an_edited_output_keeping_the_hashes_is_detected_at_load():
    run = _parked("integrity.quote_then_charge", amount=5, key="q2")
    with pgtrigger.ignore(*_APPEND_ONLY):
        JournalEntry.objects.filter(run=run, seq=0).update(output={"sum": 999})
    _wake("q2")
    run_to_end()
    assert "edited" in _stopped_for_integrity(run)
    assert not ProviderCall.objects.filter(action="test.charge").exists()


def test_an_intact_run_of_the_same_workflow_charges_what_step_0_computed():
    run = _parked("integrity.quote_then_charge", amount=5, key="q3")
    _wake("q3")
    run_to_end()
    assert fresh(run).status == "succeeded", describe(run)
    (call,) = ProviderCall.objects.filter(action="test.charge")
    assert call.payload == {"amount": 5}


# -- deleted entries: the anchor --------------------------------------------------------


def test_a_deleted_journal_tail_is_detected_and_the_step_does_not_charge_again():
    run = _parked("integrity.charge_then_wait", amount=7, key="d1")
    with pgtrigger.ignore(*_APPEND_ONLY):
        JournalEntry.objects.filter(run=run, seq=0).delete()
    _wake("d1")
    run_to_end()
    message = _stopped_for_integrity(run)
    assert "anchor" in message
    assert ProviderCall.objects.filter(action="test.charge").count() == 1


def test_a_wiped_journal_and_ledger_are_detected_and_nothing_charges_again():
    run = _parked("integrity.charge_then_wait", amount=7, key="d2")
    with pgtrigger.ignore(*_APPEND_ONLY):
        JournalEntry.objects.filter(run=run).delete()
        LedgerEntry.objects.filter(run=run).delete()
    _wake("d2")
    run_to_end()
    assert "anchor" in _stopped_for_integrity(run)
    assert ProviderCall.objects.filter(action="test.charge").count() == 1


def test_a_wiped_anchor_is_detected():
    run = _parked("integrity.charge_then_wait", amount=7, key="d3")
    WorkflowRun.objects.filter(pk=run.pk).update(journal_anchor="")
    _wake("d3")
    run_to_end()
    assert "no anchor" in _stopped_for_integrity(run)


def test_a_journal_append_whose_step_is_not_the_next_seals_over_the_real_count():
    """The one-statement append seals over ``seq + 1`` entries; when the journal holds
    another count, the anchor is sealed over what it really holds, and still verifies."""
    run = _parked("integrity.charge_then_wait", amount=7, key="gap")
    (first,) = journal(run)
    entry = JournalEntry(
        run_id=run.pk,
        seq=5,
        action_name="x",
        effect="PURE",
        state="succeeded",
        output={"n": 1},
        input_hash="h",
        generation=run.generation,
    )
    with transaction.atomic():
        evidence.append_journal(entry, first.entry_hash, "default")
    assert [e.seq for e in journal(run)] == [0, 5]
    assert evidence.verify_chains(run.pk, "default") is None


@pytest.mark.parametrize("hint", ["right", "stale"])
def test_a_ledger_append_with_a_head_hint_chains_to_the_real_end(hint):
    """The hint saves a read; a stale one (a rolled-back append, another writer) must
    never chain an entry to the wrong place."""
    run = _parked("integrity.charge_then_wait", amount=7, key=f"hint-{hint}")
    entries = list(LedgerEntry.objects.filter(run=run).order_by("id"))
    assert entries
    expect = evidence.LedgerHead.of(entries if hint == "right" else entries[:-1])
    with transaction.atomic():
        written = evidence.append_ledger(
            "default", expect=expect, run_id=run.pk, kind=LedgerEntry.Kind.CANCELED, message="x"
        )
    assert written.prev_hash == entries[-1].entry_hash
    assert (expect.count, expect.head) == (len(entries) + 1, written.entry_hash)
    assert evidence.verify_chains(run.pk, "default") is None


# -- finished runs: verifyworkflows and the admin badge ---------------------------------


@pytest.fixture
def resolved_run():
    """A run an operator confirmed and that then finished: verified by nobody since."""
    run = start_workflow_run("test.charge_blind", {"behaviour": "ambiguous"})
    run_to_end()
    assert fresh(run).status == "needs_attention"
    operator = User.objects.create_superuser("op", "op@example.com", "pw")
    resolve_effect(
        run.pk, EFFECT_CONFIRMED, evidence="gateway shows it", actor=operator, output={"id": 1}
    )
    run_to_end()
    assert fresh(run).status == "succeeded", describe(run)
    return run


def _verify() -> tuple[str, str | None]:
    out = io.StringIO()
    try:
        call_command("verifyworkflows", "--batch", "2", stdout=out)
    except CommandError as exc:
        return out.getvalue(), str(exc)
    return out.getvalue(), None


def test_verifyworkflows_passes_on_intact_runs(resolved_run):
    start_workflow_run("test.charge", {"amount": 3})
    run_to_end()
    output, error = _verify()
    assert error is None, output
    assert "verified 2 runs: 0 broken" in output


def test_the_ends_light_read_hashes_every_entry_as_the_models_do(resolved_run):
    """A run's end verifies entries read as ``row_to_json`` gave them, not as model
    instances: each must hash the same (an operator's resolution included: actor id,
    evidence, detail), or every success would stop as a broken chain."""
    from k2b_workflows.kernel import db
    from k2b_workflows.kernel.load import chains_read, chains_sql

    rows = db.fetch_statement("default", chains_sql(), [resolved_run.pk])
    light = chains_read("default", rows)[resolved_run.pk]
    models = {"journal": journal(resolved_run), "ledger": list(resolved_run.ledger.order_by("id"))}
    assert {e.kind for e in models["ledger"]} >= {
        "dispatched",
        "outcome_unknown",
        "resolved_confirmed",
    }
    assert any(e.actor_id for e in models["ledger"])
    for chain, hasher in (("journal", evidence.journal_hash), ("ledger", evidence.ledger_hash)):
        read = getattr(light, chain)
        assert [e.pk for e in read] == [e.pk for e in models[chain]]
        key = evidence.signing_key()[1]
        for stored, model in zip(read, models[chain], strict=True):
            assert type(stored) is evidence.StoredEntry
            assert hasher(stored.prev_hash, stored, key) == stored.entry_hash
            assert hasher(model.prev_hash, model, key) == stored.entry_hash
    assert evidence.verify_run(light.run, light.journal, light.ledger) is None


def test_an_edited_actor_on_a_finished_run_fails_verifyworkflows_and_shows_in_the_admin(
    resolved_run,
):
    intact = start_workflow_run("test.charge", {"amount": 3})
    run_to_end()
    with pgtrigger.ignore(*_APPEND_ONLY):
        updated = LedgerEntry.objects.filter(run=resolved_run, kind="resolved_confirmed").update(
            actor="mallory"
        )
    assert updated == 1
    output, error = _verify()
    assert error == "verified 2 runs: 1 broken"
    (line,) = output.splitlines()
    confirmed = LedgerEntry.objects.get(run=resolved_run, kind="resolved_confirmed")
    assert line.startswith(f"BROKEN {resolved_run.pk} test.charge_blind (succeeded): ledger entry")
    assert f"id {confirmed.pk}" in line and "edited" in line
    assert str(intact.pk) not in output

    client = Client()
    client.force_login(User.objects.get(username="op"))
    page = client.get(reverse("admin:k2b_workflows_workflowrun_change", args=[resolved_run.pk]))
    html = page.content.decode()
    assert "k2b-integrity-broken" in html and f"id {confirmed.pk}" in html
    page = client.get(reverse("admin:k2b_workflows_workflowrun_change", args=[intact.pk]))
    assert "k2b-integrity-verified" in page.content.decode()


# -- keyed hashes -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "number",
    [0.1, 1.5e-7, 2.5e10, 1e15, 1e16, -3e20, 1.2345678901234567e19, 1e300, 5e-324, -0.0],
)
def test_a_stored_value_is_the_value_jsonb_gives_back(number):
    """``jsonb`` keeps a number's digits but prints no exponent and has no negative zero:
    a float of 1e16 or more (``1e+16`` in JSON) reads back as an integer, -0.0 as 0.0,
    and the kernel must hash what reads back."""
    from k2b_workflows.validation import to_json_value

    value = {"n": number, "list": [number]}
    with connection.cursor() as cursor:
        cursor.execute("SELECT %s::jsonb", [canonical_json(value)])
        read_back = json.loads(cursor.fetchone()[0])
    stored = to_json_value(value, "output")
    assert stored == read_back
    assert canonical_json(stored) == canonical_json(read_back)


def test_a_step_output_with_a_large_float_verifies_and_replays_after_a_wake():
    """Step 0 returns 2.5e16 (a float), which step 1's input carries: hashed as the float,
    the journal would not verify once read back as the integer, and the replay would
    find another input."""
    run = _parked("integrity.measure_then_wait", power=16, key="m1")
    assert evidence.verify_chains(run.pk, "default") is None
    _wake("m1")
    run_to_end()
    assert fresh(run).status == "succeeded", describe(run)
    assert fresh(run).output == {"bytes": 25_000_000_000_000_000, "ratio": 1.5e-7}
    assert evidence.verify_chains(run.pk, "default") is None


def test_a_principal_hash_cannot_be_brute_forced_from_the_ledger():
    principal = {"role": "clerk", "user_id": 42}
    run = start_workflow_run("test.charge", {"amount": 3}, principal=principal)
    run_to_end()
    dispatched = LedgerEntry.objects.get(run=run, kind="dispatched")
    guesses = {
        hashlib.sha256(canonical_json({"role": role, "user_id": uid}).encode()).hexdigest()
        for role in ("clerk", "admin", "user")
        for uid in range(1000)
    }
    assert dispatched.principal_hash not in guesses
    assert dispatched.principal_hash == evidence.hash_value(principal)
    assert dispatched.input_hash not in {
        hashlib.sha256(canonical_json({"amount": n}).encode()).hexdigest() for n in range(1000)
    }


def test_rotated_keys_still_verify_and_an_unknown_key_is_a_break():
    with override_settings(K2B_WORKFLOWS={"EVIDENCE_KEYS": ["old secret"]}):
        run = _parked("integrity.charge_then_wait", amount=7, key="r1")
        old_key_id = evidence.signing_key()[0]
    with override_settings(K2B_WORKFLOWS={"EVIDENCE_KEYS": ["new secret", "old secret"]}):
        _wake("r1")
        run_to_end()
        assert fresh(run).status == "succeeded", describe(run)
        key_ids = {e.key_id for e in journal(run)}
        assert key_ids == {old_key_id, evidence.signing_key()[0]}
        assert evidence.verify_chains(run.pk, "default") is None
    with override_settings(K2B_WORKFLOWS={"EVIDENCE_KEYS": ["new secret"]}):
        problem = evidence.verify_chains(run.pk, "default")
    assert problem is not None and "no evidence key has" in str(problem)


def test_a_run_claimed_after_a_key_rotation_still_ends_in_one_round_trip(monkeypatch):
    """The ledger of a PURE run keeps the anchor its start sealed with the old key: the
    end checks it against the anchor read at the claim, not one sealed anew with the
    new key, which would send every such run through the read of its chains."""
    from k2b_workflows.kernel.ending import RunEnding

    ends = []
    as_written = RunEnding.end_as_written

    def spy(self, *args):
        ends.append(as_written(self, *args))
        return ends[-1]

    monkeypatch.setattr(RunEnding, "end_as_written", spy)
    with override_settings(K2B_WORKFLOWS={"EVIDENCE_KEYS": ["old secret"]}):
        run = start_workflow_run("kernel.tamper", {"key": "k1"})
        run_to_end()
        assert fresh(run).status == "waiting", describe(run)
    with override_settings(K2B_WORKFLOWS={"EVIDENCE_KEYS": ["new secret", "old secret"]}):
        DomainRow.objects.create(key="k1")
        wake_workflow_runs_waiting_on(app_id="tests", kind="signal", key="k1")
        run_to_end()
        assert fresh(run).status == "succeeded", describe(run)
        assert ends == [True]
        assert evidence.verify_chains(run.pk, "default") is None


def test_a_run_with_unkeyed_entries_from_before_keyed_chains_still_verifies_and_replays():
    """A run journaled before the upgrade: SHA-256 entries, anchored by migration 0007."""
    run = _parked("integrity.charge_then_wait", amount=7, key="l1")
    with pgtrigger.ignore(*_APPEND_ONLY):
        _recompute_unkeyed_journal(run)
        # Its input hash too was unkeyed then.
        JournalEntry.objects.filter(run=run, seq=0).update(
            input_hash=hashlib.sha256(canonical_json({"amount": 7}).encode()).hexdigest()
        )
        _recompute_unkeyed_journal(run)
    # Runs from before the upgrade had no anchors: migration 0007 writes them.
    WorkflowRun.objects.filter(pk=run.pk).update(journal_anchor="", ledger_anchor="")
    assert "no anchor" in str(evidence.verify_chains(run.pk, "default"))
    migration = importlib.import_module("k2b_workflows.migrations.0007_integrity")
    migration.anchor_existing_runs(None, SimpleNamespace(connection=connection))
    assert evidence.verify_chains(run.pk, "default") is None
    key_id = evidence.signing_key()[0]
    _wake("l1")
    run_to_end()
    assert fresh(run).status == "succeeded", describe(run)
    assert [e.key_id for e in journal(run)] == ["", key_id]
    assert ProviderCall.objects.filter(action="test.charge").count() == 1


# -- late results -----------------------------------------------------------------------


def test_a_late_result_is_stored_as_a_keyed_hash_and_a_redacted_summary():
    run = start_workflow_run("integrity.late_card", {})
    run_to_end()
    (late,) = LedgerEntry.objects.filter(run=run, kind="late_result")
    output = {"card_token": "tok_LIVE_51Hx", "pan": "4242424242424242"}
    assert late.output_hash == evidence.hash_value(output)
    assert late.detail == {
        "output": {
            "type": "dict",
            "size": len(canonical_json(output)),
            "keys": ["card_token", "pan"],
        },
        "outcome": "succeeded",
    }
    with connection.cursor() as cursor:
        cursor.execute("SELECT k2b_ledger::text FROM k2b_ledger WHERE run_id = %s", [run.pk])
        stored = " ".join(row[0] for row in cursor.fetchall())
    assert "tok_LIVE" not in stored and "4242424242424242" not in stored
