"""Remove each named guard, one at a time, and check that the suite notices.

A guarantee is only tested if removing its guard fails a test. Each mutant
below deletes or weakens one guard (a fence condition, the lease holder's
checks, the chain and anchor comparisons, the seals, dedup, the idempotency
conflict, the re-dispatch rule, the poll and attempt bounds, the pinned
search_path, the witness, the test-database flush, the deadline flag, the
parked step's action). The tree is copied to a temporary directory
first (the tracked files, as they are in the work tree), so the checkout
is never left mutated.

Each job keeps its test database between mutants (``--reuse-db``): creating
and migrating one took most of a mutant's time. A mutant of what a
``migrate`` installs or what the test database's setup runs (``SCHEMA``) gets
a database of its own, created for it and dropped after it, so the kept one
never holds a mutated trigger, function or grant.

    python scripts/mutants.py            # each mutant against the tests named for it
    python scripts/mutants.py --full     # each mutant against the whole fast suite
    python scripts/mutants.py fence-generation anchor   # only these

Exits non-zero if any mutant survives (no test failed), or if a mutation no
longer applies (the guarded code moved: update the table).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psycopg
from psycopg import sql

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]
    #: Further (old, new) edits of the same file: a guard written in two places,
    #: each a backstop of the other, is removed from both.
    also: tuple[tuple[str, str], ...] = ()


#: The guard that ends an asked run before its next step (``Execution.stop_if_asked``).
_STOPS_THE_NEXT_STEP = "        if not self._asked_now():\n            return\n"
_STARTS_THE_NEXT_STEP = "        if True:\n            return\n"

MUTANTS = (
    Mutant(
        "task-external-never-rerun",
        "k2b_workflows/tasks/runs.py",
        '"external": Effect.EXTERNAL}',
        '"external": Effect.IDEMPOTENT}',
        (
            "tests/tasks/test_workers.py::"
            "test_an_external_task_killed_while_running_is_never_run_again",
        ),
    ),
    Mutant(
        "task-enqueue-on-callers-connection",
        "k2b_workflows/kernel/starts.py",
        "        created = bool(db.fetch_statement(using, sql, params))",
        "        with db.autocommit_connection(using) as own, own.cursor() as cursor:\n"
        "            cursor.execute(sql, params)\n"
        "            created = cursor.fetchone() is not None",
        (
            "tests/tasks/test_contract.py::test_an_enqueue_rolled_back_never_runs",
            "tests/tasks/test_workers.py::"
            "test_a_burst_worker_does_not_run_a_task_whose_enqueue_has_not_committed",
        ),
    ),
    Mutant(
        "task-cost",
        "k2b_workflows/tasks/runs.py",
        '        spec = input_option(input, "cost")\n',
        "        spec = None\n",
        (
            "tests/tasks/test_budgets.py::"
            "test_an_external_call_priced_over_budget_by_its_worker_is_never_dispatched",
            "tests/tasks/test_budgets.py::"
            "test_a_call_the_worker_prices_over_budget_fails_and_is_never_called",
        ),
    ),
    Mutant(
        "task-budget-from-input",
        "k2b_workflows/kernel/starts.py",
        '        effect_budget = own.get("effect_budget", effect_budget)\n'
        '        fairness = own.get("fairness")\n    elif',
        '        fairness = own.get("fairness")\n    elif',
        (
            "tests/tasks/test_budgets.py::"
            "test_a_call_the_worker_prices_over_budget_fails_and_is_never_called",
            "tests/tasks/test_budgets.py::test_enqueue_many_gives_each_call_its_own_budget",
        ),
        also=(
            (
                '        effect_budget = own.get("effect_budget", effect_budget)\n'
                '        fairness = own.get("fairness")\n'
                "        if concurrency",
                '        fairness = own.get("fairness")\n        if concurrency',
            ),
        ),
    ),
    Mutant(
        "task-cost-refused",
        "k2b_workflows/kernel/execute.py",
        "        except budgets.CostRefused as exc:\n",
        "        except ZeroDivisionError as exc:\n",
        (
            "tests/tasks/test_budgets.py::"
            "test_a_cost_the_worker_cannot_compute_fails_the_call_and_the_worker_goes_on",
        ),
    ),
    Mutant(
        "task-path-check",
        "k2b_workflows/tasks/runs.py",
        "    if task.module_path != path:",
        "    if False:",
        ("tests/tasks/test_workers.py::test_a_path_that_now_names_another_task_is_not_called",),
    ),
    Mutant(
        "task-concurrency-key",
        "k2b_workflows/tasks/runs.py",
        '        "concurrency_key": None if declared is None else f"task:{path}",',
        '        "concurrency_key": None,',
        (
            "tests/tasks/test_workers.py::"
            "test_a_task_of_concurrency_one_never_runs_two_calls_at_once",
        ),
    ),
    Mutant(
        "task-columns-from-input",
        "k2b_workflows/kernel/starts.py",
        "    of_input = INPUT_COLUMNS.get(definition.name)\n    if of_input is not None:\n"
        "        own = of_input(input)",
        "    of_input = INPUT_COLUMNS.get(definition.name)\n"
        "    if of_input is not None and schedule_id is None:\n        own = of_input(input)",
        (
            "tests/tasks/test_contract.py::"
            "test_a_scheduled_task_runs_on_its_tasks_queue_with_its_priority_and_path",
        ),
    ),
    Mutant(
        "idle-probe-ours-only",
        "k2b_workflows/kernel/claim.py",
        "    terms = list(_DUE_TERMS[1:] + _HOUSEKEEPING_TERMS)",
        "    terms = list(_DUE_TERMS + _HOUSEKEEPING_TERMS)",
        (
            "tests/worker/test_idle.py::"
            "test_a_due_run_that_another_worker_takes_does_not_make_every_pass_a_full_one",
        ),
    ),
    Mutant(
        "idle-probe-claimable",
        "k2b_workflows/kernel/claim.py",
        "    if workflows:\n        selection, params = _selection(",
        "    if False:\n        selection, params = _selection(",
        ("tests/worker/test_idle.py::test_the_probe_finds_a_run_enqueued_without_a_notification",),
    ),
    Mutant(
        "idle-probe-paused",
        "k2b_workflows/kernel/claim.py",
        "        AND {flow.NOT_PAUSED} AND {flow.LINE} <= k2b_now() AND run_after",
        "        AND {flow.LINE} <= k2b_now() AND run_after",
        ("tests/worker/test_idle.py::test_a_paused_queues_due_run_leaves_the_worker_probing",),
    ),
    Mutant(
        "reenqueue-start-seal",
        "k2b_workflows/control.py",
        "    problem = seals.start_problem(run)\n    if problem is not None:",
        "    problem = seals.start_problem(run)\n    if False:",
        ("tests/admin/test_reenqueue.py::test_a_run_whose_input_was_rewritten_is_not_re_enqueued",),
    ),
    Mutant(
        "admin-selection-cap",
        "k2b_workflows/admin/views.py",
        "    if selected > MAX_SELECTED:",
        "    if False:",
        (
            "tests/admin/test_reenqueue.py::"
            "test_a_selection_past_the_cap_is_refused_whole_and_says_how_many",
        ),
    ),
    Mutant(
        "failures-sealed-attempts",
        "k2b_workflows/failures.py",
        "        kept = task_runs.sealed_attempts(run_id, rows)",
        "        kept = rows",
        (
            "tests/admin/test_failures.py::test_an_attempt_row_the_runtime_role_inserted_is_not_counted",
        ),
    ),
    Mutant(
        "task-effect-key-of-the-call",
        "k2b_workflows/tasks/backend.py",
        '    if ctx is not None and str(ctx.run_id) == result.id and not getattr(ctx, "step", 0):',
        "    if ctx is not None and str(ctx.run_id) == result.id:",
        (
            "tests/tasks/test_retry_failed.py::"
            "test_a_retried_idempotent_call_sends_the_provider_the_key_of_its_first_call",
        ),
    ),
    Mutant(
        "idle-probe-due-batch",
        "k2b_workflows/kernel/claim.py",
        "    batches.DUE_NOW_TERM,\n",
        "",
        ("tests/worker/test_idle.py::test_a_batch_whose_members_all_ended_is_work_the_probe_sees",),
    ),
    Mutant(
        "call-lock-kept-while-its-run-executes",
        "k2b_workflows/kernel/leases.py",
        "            unlocks = [run_id for run_id in self._unlocking if run_id not in executing]",
        "            unlocks = list(self._unlocking)",
        (
            "tests/kernel/test_holders.py::"
            "test_a_call_left_keeps_its_lock_while_its_run_executes_and_gives_it_back_after",
        ),
    ),
    Mutant(
        "bulk-start-row-check",
        "k2b_workflows/kernel/starts.py",
        "    if _dumped(row(template.pk, template.input), connection) != "
        "_dumped(prepared, connection):",
        "    if False:",
        (
            "tests/tasks/test_contract.py::"
            "test_enqueue_many_refuses_rows_sealed_otherwise_than_new_run_seals",
        ),
    ),
    Mutant(
        "bulk-start-per-run-columns",
        "k2b_workflows/kernel/starts.py",
        "    if not differing <= set(PER_RUN_COLUMNS):",
        "    if False:",
        (
            "tests/tasks/test_contract.py::"
            "test_enqueue_many_refuses_to_copy_a_column_new_run_makes_per_run",
        ),
    ),
    Mutant(
        "task-worker-ids-of-crashes",
        "k2b_workflows/kernel/claim.py",
        "        lease_lost_by=\"COALESCE(r.lease_lost_by, '[]'::jsonb)"
        ' || to_jsonb(r.claimed_by)",\n',
        "",
        ("tests/tasks/test_workers.py::test_a_pure_task_killed_while_running_runs_again",),
    ),
    Mutant(
        "wheel-package-data",
        "pyproject.toml",
        'k2b_workflows = ["templates/**", "static/**", "py.typed"]',
        'k2b_workflows = ["templates/**", "py.typed"]',
        (
            "tests/docs/test_wheel.py::"
            "test_the_wheel_holds_every_file_of_the_package_and_passes_twine_check",
        ),
    ),
    Mutant(
        "redispatch-when-absent",
        "k2b_workflows/kernel/effects.py",
        "                may_retry=step.action.redispatch_when_absent,\n",
        "                may_retry=False,\n",
        (
            "tests/crash/test_crash.py::"
            "test_sigkill_before_an_effect_reconciled_absent_dispatches_again_under_the_same_key",
            "tests/docs/test_docs_examples.py::"
            "test_a_charge_reconciled_absent_is_sent_again_under_its_key_and_made_once",
        ),
    ),
    Mutant(
        "claim-picks-once",
        "k2b_workflows/kernel/claim.py",
        " WHERE r.id = ANY(ARRAY(\n",
        " WHERE r.id IN (\n",
        (
            "tests/hot_path/test_claim_and_preload.py::"
            "test_a_claim_takes_no_more_runs_than_asked_whatever_the_plan",
        ),
        also=(("           FOR UPDATE SKIP LOCKED))\n", "           FOR UPDATE SKIP LOCKED)\n"),),
    ),
    Mutant(
        "claim-plan",
        "k2b_workflows/kernel/claim.py",
        "set_config('enable_sort', 'off', true)",
        "set_config('enable_sort', 'on', true)",
        (
            "tests/hot_path/test_claim_and_preload.py::"
            "test_a_claim_reads_a_few_rows_of_a_large_backlog_postgresql_has_not_analyzed",
            "tests/hot_path/test_claim_and_preload.py::"
            "test_a_claim_walks_the_line_when_another_index_finds_the_queued_runs_as_cheaply",
        ),
    ),
    Mutant(
        "claim-plan-jit",
        "k2b_workflows/kernel/claim.py",
        "set_config('jit', 'off', true)",
        "set_config('jit', 'on', true)",
        ("tests/hot_path/test_claim_and_preload.py::test_a_claim_is_never_compiled",),
    ),
    Mutant(
        "pipeline-loader-renewed",
        "k2b_workflows/kernel/pipeline.py",
        "        names.tx = _transformer(conn)",
        "        pass",
        (
            "tests/kernel/test_pipeline.py::"
            "test_installing_the_kernels_timestamp_loader_renews_the_transformer",
        ),
    ),
    Mutant(
        "pipeline-weak-context",
        "k2b_workflows/kernel/pipeline.py",
        "        self.connection = weakref.proxy(conn)",
        "        self.connection = conn",
        (
            "tests/kernel/test_pipeline.py::"
            "test_a_connection_dropped_without_close_is_freed_at_once",
        ),
    ),
    Mutant(
        "pending-since-admission",
        "k2b_workflows/kernel/flow.py",
        " AND run_after > COALESCE(%s::timestamptz, k2b_now()))",
        " AND run_after > GREATEST(k2b_now(), COALESCE(%s::timestamptz, k2b_now())))",
        (
            "tests/kernel/test_flow.py::"
            "test_a_keyed_run_due_since_the_last_admission_is_pending_work",
        ),
    ),
    Mutant(
        "exit-hooks",
        "k2b_workflows/worker/exits.py",
        "    atexit._run_exitfuncs()\n",
        "    pass\n",
        (
            "tests/worker/test_worker_start_and_exit.py::"
            "test_a_burst_ends_as_the_interpreter_would_less_the_teardown",
        ),
    ),
    Mutant(
        "fence-generation",
        "k2b_workflows/kernel/db.py",
        " WHERE id = %s AND generation = %s AND status = 'running'\nRETURNING cancel_requested_at",
        " WHERE id = %s AND %s IS NOT NULL AND status = 'running'\nRETURNING cancel_requested_at",
        ("tests/crash/test_fence.py",),
    ),
    Mutant(
        "append-fence-generation",
        "k2b_workflows/kernel/evidence.py",
        "_FENCE_WHERE = \" AND generation = %s AND status = 'running'\"",
        "_FENCE_WHERE = \" AND %s IS NOT NULL AND status = 'running'\"",
        (
            "tests/hot_path/test_journal_write.py::"
            "test_the_one_statement_journal_write_refuses_a_stale_generation",
            "tests/crash/test_fence.py::"
            "test_a_transactional_step_taken_away_while_its_action_runs_commits_nothing",
        ),
    ),
    Mutant(
        "append-journal-length",
        "k2b_workflows/kernel/evidence.py",
        '_JOURNAL_LENGTH_CHECK = "journal_length = %s"',
        '_JOURNAL_LENGTH_CHECK = "%s::int IS NOT NULL"',
        (
            "tests/hot_path/test_journal_write.py::"
            "test_the_one_statement_journal_write_refuses_an_entry_that_is_not_the_next",
            "tests/kernel/test_evidence.py::"
            "test_a_journal_append_whose_step_is_not_the_next_seals_over_the_real_count",
        ),
    ),
    Mutant(
        "end-journal-length",
        "k2b_workflows/kernel/evidence.py",
        "       AND journal_length = %s{verified}",
        "       AND %s::int IS NOT NULL{verified}",
        (
            "tests/hot_path/test_journal_write.py::"
            "test_the_one_statement_journal_write_refuses_an_entry_that_is_not_the_next",
        ),
    ),
    Mutant(
        "end-as-written-row-versions",
        "k2b_workflows/kernel/evidence.py",
        "bool_and(j.xmin = ANY(%s::xid[]))",
        "bool_and(%s::xid[] IS NOT NULL)",
        (
            "tests/kernel/test_run_ending.py::"
            "test_the_end_as_read_finds_a_tampered_entry_and_hands_the_run_over",
        ),
        also=(("bool_and(l.xmin = ANY(%s::xid[]))", "bool_and(%s::xid[] IS NOT NULL)"),),
    ),
    Mutant(
        "end-as-written-count",
        "k2b_workflows/kernel/evidence.py",
        "(SELECT count(*) = %s AND bool_and(j.xmin",
        "(SELECT %s::int IS NOT NULL AND bool_and(j.xmin",
        (
            "tests/kernel/test_run_ending.py::"
            "test_the_end_as_written_refuses_a_journal_missing_an_entry_it_wrote",
        ),
        also=(
            (
                "(SELECT count(*) = %s AND bool_and(l.xmin",
                "(SELECT %s::int IS NOT NULL AND bool_and(l.xmin",
            ),
        ),
    ),
    Mutant(
        "lease-renew-generation",
        "k2b_workflows/kernel/claim.py",
        "ON k.id = a.id AND k.generation = a.gen AND k.status = 'running'",
        "ON k.id = a.id AND k.status = 'running'",
        ("tests/crash/test_lease_guards.py",),
    ),
    Mutant(
        "reap-counts-a-dead-holder",
        "k2b_workflows/kernel/claim.py",
        "AND w.state = 'alive' AND w.heartbeat_at > k.lease_expires_at)",
        "AND w.state = 'alive')",
        (
            "tests/crash/test_lease_takeovers.py::"
            "test_a_run_that_kills_every_worker_that_claims_it_still_exhausts_its_retries",
        ),
    ),
    Mutant(
        "live-loss-free-once-per-step",
        "k2b_workflows/kernel/claim.py",
        "AND k.error_message NOT IN (",
        "AND k.error_message IS NOT NULL OR k.error_message IN (",
        (
            "tests/crash/test_lease_guards.py::"
            "test_a_second_live_loss_at_the_same_step_counts_so_a_too_short_lease_still_exhausts",
            "tests/crash/test_lease_takeovers.py::"
            "test_an_action_that_overruns_its_timeout_every_time_still_exhausts_its_retries",
        ),
    ),
    Mutant(
        "orphans-claimed-by",
        "k2b_workflows/kernel/claim.py",
        "WHERE status = 'running' AND claimed_by = %s AND NOT",
        "WHERE status = 'running' AND %s IS NOT NULL AND NOT",
        ("tests/crash/test_lease_guards.py",),
    ),
    Mutant(
        "chain-entry-hash",
        "k2b_workflows/kernel/chain_checks.py",
        "if not hmac.compare_digest(hasher(prev, entry, key), entry.entry_hash):",
        "if False:",
        ("tests/kernel/test_integrity.py",),
    ),
    Mutant(
        "anchor",
        "k2b_workflows/kernel/chain_checks.py",
        "if not hmac.compare_digest(expected, sealed):",
        "if False:",
        ("tests/kernel/test_integrity.py",),
    ),
    Mutant(
        "start-seal",
        "k2b_workflows/kernel/seals.py",
        "    why = _matches(run.start_seal, _start_text(run), keys)\n",
        "    why = None\n",
        ("tests/kernel/test_seals.py",),
    ),
    Mutant(
        "end-seal",
        "k2b_workflows/kernel/seals.py",
        "    if run.status not in SEALED_STATUSES:\n        return None",
        "    if True:\n        return None",
        ("tests/kernel/test_seals.py",),
    ),
    Mutant(
        "dedup-values",
        "k2b_workflows/dedup.py",
        "            if stored != value:",
        "            if False:",
        ("tests/kernel/test_dedup.py",),
    ),
    Mutant(
        "idempotency-conflict",
        "k2b_workflows/kernel/starts.py",
        "    if found.input != input:",
        "    if False:",
        ("tests/kernel/test_control.py", "tests/docs/test_docs_examples.py"),
    ),
    Mutant(
        "idempotency-principal",
        "k2b_workflows/kernel/starts.py",
        "    if found.principal != principal:",
        "    if False:",
        ("tests/docs/test_docs_examples.py",),
    ),
    Mutant(
        "re-dispatch",
        "k2b_workflows/kernel/effects.py",
        "        if state.open_key:\n            # Dispatched before",
        "        if False:\n            # Dispatched before",
        ("tests/docs/test_testing_recipes.py", "tests/kernel/test_retries.py"),
    ),
    Mutant(
        "reconcile-poll-bound",
        "k2b_workflows/kernel/effects.py",
        "if isinstance(result, Waiting) and state.polls >= settings.max_reconcile_polls():",
        "if False:",
        ("tests/misuse/test_misuse_runs.py",),
    ),
    Mutant(
        "attempt-bound",
        "k2b_workflows/kernel/ending.py",
        "        if failures >= retrying.max_attempts(policy):\n            self.exhausted",
        "        if False:\n            self.exhausted",
        (
            "tests/kernel/test_retries.py::test_the_third_failure_in_a_row_fails_the_run_there_and_then",
        ),
    ),
    Mutant(
        "attempt-bound-at-claim",
        "k2b_workflows/kernel/execute.py",
        "            if run.consecutive_failures >= retrying.claim_bound(self.definition):",
        "            if False:",
        (
            "tests/kernel/test_retries.py::test_a_run_claimed_at_the_limit_fails_without_running_a_step",
        ),
        # The step's own bound, before its action runs, backs the claim's up.
        also=(
            (
                "        if self.run.consecutive_failures"
                " >= retrying.max_attempts(self.retry_policy):",
                "        if False:",
            ),
        ),
    ),
    Mutant(
        "failures-reset-only-by-the-kernel",
        "k2b_workflows/migrations/0027_attempts_and_limits_sealed.py",
        """condition='WHEN (NEW."consecutive_failures" < """,
        """condition='WHEN (FALSE AND NEW."consecutive_failures" < """,
        (
            "tests/misuse/test_sealed_attempts.py::"
            "test_a_failure_count_set_back_by_the_runtime_role_is_refused_and_the_bound_holds",
        ),
    ),
    Mutant(
        "attempts-seq-never-decreases",
        "k2b_workflows/migrations/0027_attempts_and_limits_sealed.py",
        """condition='WHEN (NEW."attempts_seq" < (OLD."attempts_seq"))',""",
        """condition='WHEN (FALSE AND NEW."attempts_seq" < (OLD."attempts_seq"))',""",
        ("tests/misuse/test_sealed_attempts.py::test_the_number_of_resets_never_goes_back",),
    ),
    Mutant(
        "requeue-after-end-only-by-the-kernel",
        "k2b_workflows/migrations/0027_attempts_and_limits_sealed.py",
        """condition='WHEN (OLD."status" IN (\\'failed\\', \\'needs_attention\\')""",
        """condition='WHEN (FALSE AND OLD."status" IN (\\'failed\\', \\'needs_attention\\')""",
        (
            "tests/misuse/test_sealed_attempts.py::"
            "test_a_failed_run_is_queued_again_only_by_an_operator",
        ),
    ),
    Mutant(
        "attempts-seal-checked-at-claim",
        "k2b_workflows/kernel/execute.py",
        "        reset = seals.attempts_problem(loaded.run)\n",
        "        reset = None\n",
        (
            "tests/misuse/test_sealed_attempts.py::"
            "test_a_reset_forged_under_a_number_of_its_own_stops_the_run_at_its_claim",
            "tests/misuse/test_sealed_attempts.py::"
            "test_a_failed_run_is_queued_again_only_by_an_operator",
        ),
    ),
    Mutant(
        "start-seal-covers-routes",
        "k2b_workflows/kernel/seals.py",
        "    if routed:\n        fields += [",
        "    if False:\n        fields += [",
        (
            "tests/misuse/test_sealed_rows.py::"
            "test_a_tasks_route_rewritten_by_the_runtime_role_is_refused_at_its_claim",
        ),
    ),
    Mutant(
        "budget-limits-sealed",
        "k2b_workflows/kernel/budgets.py",
        "    if row is not None:\n        _sealed(root_id, row)\n",
        "",
        (
            "tests/misuse/test_attacks_flow.py::"
            "test_the_owners_raised_budget_charges_nothing_more_and_verifyworkflows_names_it",
        ),
    ),
    Mutant(
        "budget-limits-in-verifyworkflows",
        "k2b_workflows/kernel/flow_audit.py",
        "        lines.extend(_limits(cursor))\n",
        "",
        (
            "tests/misuse/test_attacks_flow.py::"
            "test_the_owners_raised_budget_charges_nothing_more_and_verifyworkflows_names_it",
        ),
    ),
    Mutant(
        "pinned-search-path",
        "k2b_workflows/triggers.py",
        '        return template.replace("$$ LANGUAGE plpgsql;", pinned)',
        "        return template",
        ("tests/misuse/test_attacks.py",),
    ),
    Mutant(
        "transitions-checked-in-when",
        "k2b_workflows/migrations/0026_transition_checks_in_when.py",
        r"""AND NOT (pg_catalog.concat(OLD."status", \':\', NEW."status") = ANY(\'{"""
        r"""queued:running,queued:canceled,running:queued,running:waiting""",
        r"""OR FALSE AND NOT (pg_catalog.concat(OLD."status", \':\', NEW."status") = ANY(\'{"""
        r"""queued:running,queued:canceled,running:queued,running:waiting""",
        ("tests/kernel/test_integrity.py::test_a_claim_and_an_end_call_no_trigger_function",),
    ),
    Mutant(
        "end-tries-the-waiters-lock-in-when",
        "k2b_workflows/migrations/0026_transition_checks_in_when.py",
        "THEN NOT pg_catalog.pg_try_advisory_xact_lock(",
        "THEN TRUE OR NOT pg_catalog.pg_try_advisory_xact_lock(",
        ("tests/kernel/test_integrity.py::test_a_claim_and_an_end_call_no_trigger_function",),
    ),
    Mutant(
        "ends-together-same-task",
        "k2b_workflows/worker/runner.py",
        "        ready = self.claims.next_ready_if(lambda loaded: _kind(loaded) == kind)",
        "        ready = self.claims.next_ready_if(lambda loaded: True)",
        (
            "tests/worker/test_ends_together.py::"
            "test_pure_ends_of_one_task_commit_together_and_no_other_end_joins_them",
        ),
    ),
    Mutant(
        "ends-together-pure-ends-only",
        "k2b_workflows/kernel/ending.py",
        "        if together is not None and not _pure_only(pending):",
        "        if False:",
        (
            "tests/worker/test_ends_together.py::"
            "test_pure_ends_of_one_task_commit_together_and_no_other_end_joins_them",
            "tests/worker/test_ends_together.py::"
            "test_workflow_runs_whose_ends_are_pure_commit_together_and_an_effects_end_never",
        ),
    ),
    Mutant(
        "ends-together-refusal-reaches-each-end",
        "k2b_workflows/kernel/together.py",
        "        if self._error is not None:\n            raise self._error",
        "        if False:\n            raise self._error",
        (
            "tests/worker/test_ends_together.py::"
            "test_a_run_canceled_while_its_end_waits_stays_canceled_and_the_others_end",
        ),
    ),
    Mutant(
        "ends-together-bounded",
        "k2b_workflows/kernel/together.py",
        "            and self.ends < self.max_ends",
        "            and True",
        ("tests/worker/test_ends_together.py::test_a_batch_is_no_larger_than_the_setting",),
    ),
    Mutant(
        "ends-together-prefetch-own-time",
        "k2b_workflows/worker/runner.py",
        "                    started += together.joined_seconds - joined",
        "                    pass",
        ("tests/worker/test_ends_together.py::test_the_prefetch_counts_each_runs_time_once",),
    ),
    Mutant(
        "witness-ledger-head",
        "k2b_workflows/kernel/witness.py",
        '        elif record["ledger"] and head != record["head"]:',
        "        elif False:",
        ("tests/kernel/test_witness.py",),
    ),
    Mutant(
        "witness-mac-of-record",
        "k2b_workflows/kernel/witness.py",
        '    record["mac"] = f"{key_id}:{hashing.hmac_hex(key, hashing.canonical(record))}"',
        '    record["mac"] = f"{key_id}:{hashing.hmac_hex(key, hashing.canonical({}))}"',
        ("tests/kernel/test_witness.py",),
    ),
    Mutant(
        "flush-only-test-databases",
        "k2b_workflows/testdb.py",
        "    if not test_environment_active():\n        return False\n    name =",
        "    return True\n    name =",
        ("tests/docs/test_fresh_project.py",),
    ),
    Mutant(
        "flush-past-append-only",
        "k2b_workflows/management/commands/flush.py",
        "        with pgtrigger.ignore(*testdb.APPEND_ONLY_TRIGGERS, databases=[using]):",
        "        if True:",
        ("tests/docs/test_fresh_project.py",),
    ),
    Mutant(
        "deadline-passed-this-step",
        "k2b_workflows/kernel/context.py",
        "    return run.wait_deadline is not None and run.wait_step == step",
        "    return run.wait_deadline is not None",
        ("tests/kernel/test_step_clock.py",),
    ),
    Mutant(
        "parked-action-compared",
        "k2b_workflows/kernel/execute.py",
        "        if seq != self.run.wait_step or not parked or parked == name:",
        "        if True:",
        ("tests/kernel/test_parked_change.py",),
    ),
    Mutant(
        "supervisor-config-stops-group",
        "k2b_workflows/worker/supervisor.py",
        "        if code in (EXIT_CONFIG, EXIT_UNAVAILABLE):",
        "        if False:",
        (
            "tests/worker/test_processes.py::"
            "test_a_configuration_error_in_the_workers_stops_the_group_without_restarting_them",
        ),
    ),
    Mutant(
        "supervisor-forwards-stop",
        "k2b_workflows/worker/supervisor.py",
        'back now")\n        self._signal_children(signal.SIGTERM)',
        'back now")',
        (
            "tests/worker/test_processes.py::"
            "test_sigterm_of_the_supervisor_hands_every_run_back_and_exits_zero_after_its_children",
        ),
    ),
    Mutant(
        "supervisor-restarts-a-dead-child",
        "k2b_workflows/worker/supervisor.py",
        "        slot.restart_at = time.monotonic() + delay",
        "        slot.done = True",
        (
            "tests/worker/test_processes.py::"
            "test_a_sigkilled_worker_process_is_restarted_and_no_run_is_lost_or_its_effect_repeated",
        ),
    ),
    Mutant(
        "riding-pure-only",
        "k2b_workflows/kernel/journal.py",
        "            and pending.step.action.effect == Effect.PURE\n"
        "            and pending.ledger_kind is None\n",
        "",
        (
            "tests/kernel/test_run_journal.py::"
            "test_a_success_that_is_not_pure_is_written_before_the_next_step_runs",
        ),
    ),
    Mutant(
        "riding-bound",
        "k2b_workflows/kernel/journal.py",
        "            and len(pending.riding) < MAX_RIDING\n",
        "",
        ("tests/kernel/test_run_journal.py::test_pure_successes_ride_on_one_write_up_to_a_bound",),
    ),
    Mutant(
        "riding-on-the-park",
        "k2b_workflows/kernel/ending.py",
        "            if deferred is not None:\n"
        "                self.journal.write_pending(deferred)\n",
        "",
        ("tests/hot_path/test_batching.py::test_pure_successes_ride_on_a_park",),
    ),
    Mutant(
        "riding-on-the-transactional-block",
        "k2b_workflows/kernel/effects.py",
        "                evidence.append_journal_fenced(\n"
        "                    pending.entries,\n"
        "                    prev,\n"
        "                    self.using,\n"
        "                    lease_ms=settings.lease_ms(),\n"
        "                    reset=journal.reset,\n"
        "                )\n",
        "                pass\n",
        (
            "tests/crash/test_crash.py::"
            "test_a_pure_step_whose_success_rode_on_a_committed_write_never_runs_again",
        ),
    ),
    Mutant(
        "waiter-holds-result-lock",
        "k2b_workflows/results.py",
        "    return bool(db.fetchall(using, _WAIT_ON_SQL, [str(run_id)])[0][0])\n",
        "    return False\n",
        (
            "tests/kernel/test_results.py::test_wait_returns_the_succeeded_run_when_a_worker_ends_it",
            "tests/kernel/test_results.py::test_wait_returns_a_canceled_run",
        ),
    ),
    Mutant(
        "wait-sees-its-own-savepoint",
        "k2b_workflows/results.py",
        "                THEN pg_catalog.pg_xact_status(x.mine::text::xid8) = 'in progress'\n",
        "                THEN x.mine = x.top\n",
        (
            "tests/kernel/test_results.py::test_waiting_inside_the_transaction_that_started_the_run_in_a_savepoint_is_refused",
        ),
    ),
    Mutant(
        "resolve-confirmed-needs-output",
        "k2b_workflows/management/commands/workflowrun.py",
        "        if output is None and DECISIONS[decision] == control.EFFECT_CONFIRMED:\n",
        "        if False:\n",
        ("tests/admin/test_workflowrun_command.py::test_resolve_refusals_change_nothing",),
    ),
    Mutant(
        "supervisor-no-orphans",
        "k2b_workflows/worker/supervisor.py",
        "        kernel_signals = set_parent_death_signal(signal.SIGTERM)\n",
        "        kernel_signals = True\n",
        (
            "tests/worker/test_processes.py::test_sigkill_of_the_supervisor_takes_every_worker_process_with_it",
        ),
    ),
    Mutant(
        "supervisor-death-one-sigterm",
        "k2b_workflows/worker/supervisor.py",
        "        if not kernel_signals:\n",
        "        if True:\n",
        (
            "tests/worker/test_processes.py::"
            "test_sigkill_of_the_supervisor_lets_each_child_finish_its_external_step_as_after_one_sigterm",
        ),
    ),
    Mutant(
        "test-db-drop-closes-listener",
        "k2b_workflows/testdb.py",
        "    listener.stop()\n",
        "    pass\n",
        (
            "tests/docs/test_fresh_project.py::"
            "test_pytest_django_with_and_without_transaction_passes_in_a_fresh_project",
        ),
    ),
    Mutant(
        "astart-passes-every-argument",
        "k2b_workflows/aio.py",
        "        priority=priority,\n",
        "",
        (
            "tests/kernel/test_results_async.py::"
            "test_astart_workflow_run_passes_flow_control_and_scheduling_through",
        ),
    ),
    Mutant(
        "live-means-fresh",
        "k2b_workflows/fleet.py",
        "        [settings.worker_fresh_ms()],\n",
        "        [settings.worker_lost_after_ms()],\n",
        (
            "tests/worker/test_fleet.py::"
            "test_a_worker_silent_for_longer_than_fresh_is_not_live_before_it_is_marked_lost",
        ),
    ),
    Mutant(
        "isolation-level-check",
        "k2b_workflows/checks.py",
        "        if level != READ_COMMITTED\n",
        "        if False\n",
        (
            "tests/misuse/test_checks.py::"
            "test_repeatable_read_on_djangos_connection_is_a_warning_naming_the_level",
            "tests/misuse/test_checks.py::"
            "test_a_server_default_of_serializable_is_a_warning_for_the_kernels_own_connections",
        ),
    ),
    Mutant(
        "admin-last-waited-for",
        "k2b_workflows/admin/runs.py",
        "        if obj is not None and obj.status != RunStatus.WAITING:\n",
        "        if False:\n",
        (
            "tests/admin/test_admin.py::"
            "test_a_run_that_waited_and_ended_shows_what_it_last_waited_for_not_waiting_for",
        ),
    ),
    Mutant(
        "worker-names-unknown-apps",
        "k2b_workflows/worker/selection.py",
        "            if app_id not in known:\n",
        "            if False:\n",
        (
            "tests/worker/test_worker_command.py::"
            "test_an_app_id_no_registered_workflow_has_is_named_at_start_with_the_known_ones",
        ),
    ),
    Mutant(
        "worker-counts-outcome-values",
        "k2b_workflows/worker/runner.py",
        "                self.stats[str(outcome)] += 1\n",
        "                self.stats[outcome] += 1\n",
        (
            "tests/worker/test_worker_command.py::"
            "test_the_stop_summary_prints_each_outcome_by_its_value",
        ),
    ),
    Mutant(
        "workers-page-late",
        "k2b_workflows/admin/workers.py",
        "        if silent_ms > settings.worker_fresh_ms():\n",
        "        if False:\n",
        (
            "tests/worker/test_fleet.py::"
            "test_the_workers_page_calls_a_worker_late_once_its_heartbeat_is_not_fresh",
        ),
    ),
    Mutant(
        "schedule-seal-pass",
        "k2b_workflows/kernel/schedule_passes.py",
        "            if tampered is not None:\n",
        "            if False:\n",
        (
            "tests/misuse/test_sealed_rows.py::"
            "test_the_issues_attack_a_schedule_row_the_runtime_role_inserted_charges_nothing",
            "tests/misuse/test_sealed_rows.py::"
            "test_an_operators_schedule_row_edited_by_the_runtime_role_starts_nothing",
            "tests/misuse/test_sealed_rows.py::test_a_renamed_and_rewound_schedule_fires_no_tick_again",
        ),
    ),
    Mutant(
        "schedule-seal-save",
        "k2b_workflows/models/schedules.py",
        '            if tampered and not getattr(self, "reviewed", False):\n',
        "            if False:\n",
        (
            "tests/misuse/test_sealed_rows.py::"
            "test_a_tampered_row_is_sealed_again_only_by_a_save_of_its_whole_spec",
        ),
    ),
    Mutant(
        "schedule-seal-run-now",
        "k2b_workflows/scheduling.py",
        "    if tampered is not None:\n        raise InvalidInput(",
        "    if False:\n        raise InvalidInput(",
        (
            "tests/misuse/test_sealed_rows.py::"
            "test_a_tampered_row_is_sealed_again_only_by_a_save_of_its_whole_spec",
        ),
    ),
    Mutant(
        "ai-request-seal",
        "k2b_workflows/kernel/ai.py",
        "        if forged is not None:\n",
        "        if False:\n",
        (
            "tests/misuse/test_sealed_rows.py::"
            "test_an_ai_task_request_the_runtime_role_wrote_never_reaches_the_provider",
        ),
    ),
    Mutant(
        "waiter-end-seal",
        "k2b_workflows/results.py",
        "        if forged is not None:\n",
        "        if False:\n",
        (
            "tests/misuse/test_sealed_rows.py::"
            "test_wait_for_workflow_run_refuses_an_end_the_runtime_role_wrote",
            "tests/misuse/test_sealed_rows.py::"
            "test_await_workflow_run_refuses_an_end_the_runtime_role_wrote",
        ),
    ),
    Mutant(
        "clock-reads-no-setting",
        "k2b_workflows/migrations/0020_sealed_schedules_and_clock.py",
        "    RETURN pg_catalog.statement_timestamp();\n",
        "    RETURN pg_catalog.statement_timestamp() + COALESCE(NULLIF(pg_catalog.current_setting("
        "'k2b.clock_offset', true), ''), '0')::interval;\n",
        (
            "tests/misuse/test_clock_attacks.py::test_a_runtime_role_session_cannot_move_k2b_now",
            "tests/misuse/test_clock_attacks.py::"
            "test_through_a_transaction_pooler_a_left_setting_does_not_move_the_next_clients_clock",
        ),
    ),
    Mutant(
        "clock-offset-off-after-test",
        "k2b_workflows/testing.py",
        "        _honour_offset(False)\n",
        "        pass\n",
        (
            "tests/misuse/test_clock_attacks.py::"
            "test_the_controlled_clock_moves_k2b_now_while_it_runs_and_not_after",
        ),
    ),
    Mutant(
        "witness-goes-somewhere",
        "k2b_workflows/checks.py",
        "    if witness.goes_somewhere():\n",
        "    if True:\n",
        ("tests/misuse/test_witness_check.py",),
    ),
    Mutant(
        "schedule-span-cap",
        "k2b_workflows/schedules.py",
        "    if every > MAX_SPAN:\n",
        "    if False:\n",
        ("tests/schedules/test_schedule_bad_inputs.py",),
        also=(("    if jitter > MAX_SPAN:\n", "    if False:\n"),),
    ),
    Mutant(
        "schedule-jitter-under-every",
        "k2b_workflows/schedules.py",
        "self.jitter is not None and self.jitter >= self.every:",
        "self.jitter is not None and False:",
        ("tests/schedules/test_schedule_bad_inputs.py",),
    ),
    Mutant(
        "schedule-zone-with-every",
        "k2b_workflows/schedules.py",
        'if self.every is not None and self.timezone != "UTC":',
        "if False:",
        ("tests/schedules/test_schedule_bad_inputs.py",),
    ),
    Mutant(
        "schedule-cron-step",
        "k2b_workflows/schedules.py",
        "            if len(step) > 4 or int(step) > largest:\n",
        "            if False:\n",
        ("tests/schedules/test_schedule_bad_inputs.py",),
    ),
    Mutant(
        "flushable-by-name",
        "k2b_workflows/testdb.py",
        "    if test_environment_active() and _named_as_a_test_database(using):\n",
        "    if test_environment_active():\n",
        (
            "tests/misuse/test_low_findings.py::"
            "test_a_no_op_migrate_of_the_live_database_does_not_make_it_flushable",
        ),
    ),
    Mutant(
        "trace-context-sane",
        "k2b_workflows/tracing.py",
        "    stored = stored_context(run.pk, run.trace_context)\n    span_context",
        "    stored = run.trace_context or {}\n    span_context",
        (
            "tests/misuse/test_low_findings.py::test_a_garbage_trace_context_is_ignored_with_one_warning",
        ),
        also=(
            (
                "        stored = stored_context(run.pk, run.trace_context)\n        links",
                "        stored = run.trace_context or {}\n        links",
            ),
            (
                "        stored_context(execution.run.pk, execution.run.trace_context)\n",
                "        execution.run.trace_context or {}\n",
            ),
        ),
    ),
    Mutant(
        "redact-shaped-secrets",
        "k2b_workflows/redaction.py",
        "    text = _SHAPED_SECRET_RE.sub(REDACTED, text)\n",
        "",
        ("tests/misuse/test_low_findings.py::test_bare_stripe_and_aws_credentials_are_scrubbed",),
    ),
    Mutant(
        "flow-admit-holders-limit",
        "k2b_workflows/migrations/0021_flow_guards.py",
        '    SELECT min(concurrency_limit) INTO cap FROM "public".k2b_run\n',
        '    SELECT NULL INTO cap FROM "public".k2b_run\n',
        (
            "tests/misuse/test_attacks_flow.py::test_an_inserted_run_with_a_limit_of_1000_admits_nobody",
        ),
    ),
    Mutant(
        "runtime-frozen-run-columns",
        "k2b_workflows/roles.py",
        '    "k2b_run": ("workflow_name", "concurrency_key", "concurrency_limit", "holds_slot"),',
        '    "k2b_run": (),',
        (
            "tests/misuse/test_attacks_flow.py::"
            "test_setting_holds_slot_puts_no_second_run_inside_a_limit_1_key",
            "tests/misuse/test_attacks_flow.py::test_moving_a_run_off_its_key_is_refused",
        ),
    ),
    Mutant(
        "runtime-frozen-budget-columns",
        "k2b_workflows/roles.py",
        '    "k2b_budget_account": ("root_id", "effect_budget", "max_ai_calls", "max_steps",'
        ' "limits_seal"),',
        '    "k2b_budget_account": ("root_id",),',
        (
            "tests/misuse/test_attacks_flow.py::test_a_tree_budget_of_3_lets_3_emails_through_whatever_the_account_says",
        ),
    ),
    Mutant(
        "runtime-reads-only-rate-stamps",
        "k2b_workflows/roles.py",
        'RUNTIME_READS_ONLY = ("k2b_rate_dispatch",)',
        "RUNTIME_READS_ONLY = ()",
        ("tests/misuse/test_attacks_flow.py::test_the_rate_stamps_hold_a_2_per_hour_limit",),
    ),
    Mutant(
        "rate-stamp-own-window",
        "k2b_workflows/migrations/0021_flow_guards.py",
        "       AND at <= now_ - COALESCE(window_ms, p_per_ms) * interval '1 millisecond';",
        "       AND at <= now_ - p_per_ms * interval '1 millisecond';",
        ("tests/misuse/test_attacks_flow.py::test_the_rate_stamps_hold_a_2_per_hour_limit",),
    ),
    Mutant(
        "slot-never-inserted",
        "k2b_workflows/migrations/0021_flow_guards.py",
        "func=\"RAISE EXCEPTION 'k2b_workflows: a run is inserted without a slot "
        "(admission gives it one)' USING ERRCODE = 'insufficient_privilege';\",",
        'func="RETURN NEW;",',
        ("tests/misuse/test_attacks_flow.py::test_an_inserted_run_holding_a_slot_is_refused",),
    ),
    Mutant(
        "slot-held-while-leased",
        "k2b_workflows/migrations/0028_slot_release_asks_the_holder.py",
        'ELSIF (NEW.lease_expires_at IS NULL OR NEW.lease_expires_at <= \\"public\\".k2b_now()) '
        "AND (OLD.claimed_by = '' OR pg_catalog.pg_try_advisory_xact_lock("
        "pg_catalog.hashtextextended('k2b.worker:' || OLD.claimed_by, 0))) THEN",
        "ELSIF true THEN",
        ("tests/worker/test_flow_slots_held.py",),
    ),
    Mutant(
        "slot-release-asks-the-holder",
        "k2b_workflows/migrations/0028_slot_release_asks_the_holder.py",
        " AND (OLD.claimed_by = '' OR pg_catalog.pg_try_advisory_xact_lock("
        "pg_catalog.hashtextextended('k2b.worker:' || OLD.claimed_by, 0))) THEN",
        " THEN",
        (
            "tests/crash/test_live_holders.py::"
            "test_a_canceled_holder_keeps_its_slot_whatever_its_lease_is_rewritten_to",
        ),
    ),
    Mutant(
        "slot-holder-name-frozen",
        "k2b_workflows/migrations/0028_slot_release_asks_the_holder.py",
        "RAISE EXCEPTION 'k2b_workflows: the holder of an ended run that holds a slot never "
        "changes' USING ERRCODE = 'insufficient_privilege';",
        "NULL;",
        (
            "tests/crash/test_live_holders.py::"
            "test_a_canceled_holder_keeps_its_slot_whatever_its_lease_is_rewritten_to",
        ),
    ),
    Mutant(
        "presence-lock",
        "k2b_workflows/kernel/leases.py",
        "            if self.worker_id and not self.present.is_set() and not self._proxied:",
        "            if False:",
        (
            "tests/crash/test_live_holders.py::"
            "test_a_holder_stopped_inside_an_external_call_past_its_lease_keeps_the_run",
            "tests/crash/test_live_holders.py::"
            "test_a_canceled_holder_keeps_its_slot_whatever_its_lease_is_rewritten_to",
        ),
    ),
    Mutant(
        "takeover-leaves-a-present-holder",
        "k2b_workflows/kernel/claim.py",
        "_HELD = (\n"
        "    f\"(({holders.IN_CALL} AND {holders.inside('k.claimed_by', 'k.id::text')})\"\n"
        "    f\" OR (k.holds_slot AND {holders.present('k.claimed_by')}))\"\n"
        ")\n",
        '_HELD = "false"\n',
        ("tests/crash/test_live_holders.py",),
    ),
    Mutant(
        "only-a-call-or-a-slot-is-left-to-its-holder",
        "k2b_workflows/kernel/claim.py",
        "    f\"(({holders.IN_CALL} AND {holders.inside('k.claimed_by', 'k.id::text')})\"\n"
        "    f\" OR (k.holds_slot AND {holders.present('k.claimed_by')}))\"\n",
        "    f\"((true AND {holders.present('k.claimed_by')})\"\n"
        "    f\" OR (true AND {holders.present('k.claimed_by')}))\"\n",
        (
            "tests/crash/test_lease_takeovers.py::"
            "test_a_live_worker_whose_keeper_renewed_too_late_loses_the_run_without_a_failure",
        ),
    ),
    Mutant(
        "the-reap-asks-the-call-lock",
        "k2b_workflows/kernel/claim.py",
        "{holders.inside('k.claimed_by', 'k.id::text')}",
        "{holders.present('k.claimed_by')}",
        (
            "tests/crash/test_live_holders.py::"
            "test_a_dispatch_whose_answer_was_lost_is_reconciled_though_its_worker_lives",
        ),
    ),
    Mutant(
        "a-reporting-holder-is-inside-only-while-its-call-lock-is-held",
        "k2b_workflows/kernel/holders.py",
        'f" THEN NOT pg_catalog.pg_try_advisory_xact_lock({call})"',
        'f" THEN pg_catalog.pg_try_advisory_xact_lock({call}) OR true"',
        (
            "tests/kernel/test_holders.py::test_a_live_worker_out_of_the_call_is_not_waited_for",
            "tests/crash/test_live_holders.py::"
            "test_a_dispatch_whose_answer_was_lost_is_reconciled_though_its_worker_lives",
        ),
    ),
    Mutant(
        "a-call-is-locked-before-it-is-dispatched",
        "k2b_workflows/kernel/leases.py",
        "            if self._reporting:\n                unlocks = self._unlocking\n",
        "            if False:\n                unlocks = self._unlocking\n",
        (
            "tests/kernel/test_holders.py::test_a_live_worker_out_of_the_call_is_not_waited_for",
            "tests/crash/test_live_holders.py::"
            "test_a_run_set_back_to_queued_is_not_reconciled_while_its_holder_is_inside_the_call",
        ),
    ),
    Mutant(
        "calls-are-locked-before-the-keeper-reports",
        "k2b_workflows/kernel/leases.py",
        "        for run_id in self._calls - self._locked_calls:\n",
        "        for run_id in ():\n",
        (
            "tests/kernel/test_holders.py::"
            "test_a_keeper_that_reconnects_inside_a_call_locks_it_before_it_reports",
        ),
    ),
    Mutant(
        "replay-waits-for-the-holder",
        "k2b_workflows/kernel/effects.py",
        "        holder = holders.still_in_call(",
        "        holder = None and holders.still_in_call(",
        (
            "tests/crash/test_live_holders.py::"
            "test_a_run_set_back_to_queued_is_not_reconciled_while_its_holder_is_inside_the_call",
        ),
    ),
    Mutant(
        "a-holders-answer-ends-the-wait",
        "k2b_workflows/kernel/holders.py",
        "                    WHERE a.run_id = %s AND a.seq = %s AND a.id > d.id\n",
        "                    WHERE a.run_id = %s AND a.seq = %s AND a.id > d.id AND false\n",
        (
            "tests/kernel/test_holders.py",
            "tests/crash/test_live_holders.py::"
            "test_a_run_set_back_to_queued_is_not_reconciled_while_its_holder_is_inside_the_call",
        ),
    ),
    Mutant(
        "reconcile-against-the-late-answer",
        "k2b_workflows/kernel/effects.py",
        "            self._against_the_late_answer(step, result)",
        "            pass",
        (
            "tests/crash/test_live_holders.py::"
            "test_a_reconcile_that_contradicts_the_calls_own_late_answer_is_an_incident",
        ),
    ),
    Mutant(
        "keeper-leaves-on-its-own-connection",
        "k2b_workflows/kernel/execute.py",
        "                    self.keeper.leave(self.run_id, self.generation)",
        "                    flow.leave(self.using, self.run_id, self.generation)",
        (
            "tests/worker/test_flow_slots_held.py::"
            "test_a_canceled_action_keeps_its_slot_until_it_has_left_run",
        ),
    ),
    Mutant(
        "late-result-contradiction",
        "k2b_workflows/kernel/journal.py",
        "            said = contradictions.contradicted(",
        "            said = None and contradictions.contradicted(",
        (
            "tests/crash/test_live_holders.py::"
            "test_a_late_result_that_contradicts_a_reconcile_is_an_incident_naming_both",
        ),
    ),
    Mutant(
        "contradiction-raises-an-incident",
        "k2b_workflows/kernel/journal.py",
        "                contradictions.raise_incident(self.using,",
        "                (lambda *_: None)(self.using,",
        (
            "tests/crash/test_live_holders.py::"
            "test_a_late_result_that_contradicts_a_reconcile_is_an_incident_naming_both",
        ),
    ),
    Mutant(
        "verify-names-contradictions",
        "k2b_workflows/management/commands/verifyworkflows.py",
        "        contradicted = contradictions.findings(using)",
        "        contradicted: list[str] = []",
        (
            "tests/crash/test_live_holders.py::"
            "test_a_late_result_that_contradicts_a_reconcile_is_an_incident_naming_both",
        ),
    ),
    Mutant(
        "cancel-keeps-a-holders-lease",
        "k2b_workflows/kernel/interventions.py",
        "       lease_expires_at = CASE WHEN status = 'running' AND holds_slot\n"
        "                               THEN lease_expires_at END\n",
        "       lease_expires_at = NULL\n",
        ("tests/worker/test_flow_slots_held.py",),
    ),
    Mutant(
        # Without a presence lock (the keeper could not take it), the lease it holds
        # is what keeps a canceled holder's slot: removed from both.
        "keeper-holds-a-canceled-holders-lease",
        "k2b_workflows/kernel/leases.py",
        "            flow.hold_slots(",
        "            (lambda *_: None)(",
        (
            "tests/worker/test_flow_slots_held.py::"
            "test_a_canceled_action_keeps_its_slot_until_it_has_left_run",
        ),
        also=(
            (
                "            if self.worker_id and not self.present.is_set()"
                " and not self._proxied:",
                "            if False:",
            ),
        ),
    ),
    Mutant(
        "cancel-in-progress-spares-incidents",
        "k2b_workflows/kernel/flow.py",
        '_CANCELABLE_HOLDERS = frozenset({"queued", "running", "waiting"})',
        '_CANCELABLE_HOLDERS = frozenset({"queued", "running", "waiting", "needs_attention"})',
        (
            "tests/worker/test_flow_slots_held.py::"
            "test_cancel_in_progress_leaves_a_holder_that_needs_an_operator_in_the_queue",
        ),
    ),
    Mutant(
        "slot-sweep-of-ended-runs",
        "k2b_workflows/kernel/flow.py",
        "       AND (lease_expires_at IS NULL OR lease_expires_at <= k2b_now())\n"
        "       AND {HOLDER_GONE}\n",
        "       AND false\n",
        (
            "tests/misuse/test_attacks_flow.py::"
            "test_holds_slot_on_a_finished_run_is_refused_and_healed_when_the_owner_sets_it",
        ),
    ),
    Mutant(
        "budget-spent-from-charges",
        "k2b_workflows/kernel/budgets.py",
        "        if summed is not None:\n            spent = _json(summed)",
        "        if False:\n            spent = _json(summed)",
        (
            "tests/misuse/test_attacks_flow.py::test_a_tree_budget_of_3_lets_3_emails_through_whatever_the_account_says",
        ),
    ),
    Mutant(
        "verify-flow-findings",
        "k2b_workflows/management/commands/verifyworkflows.py",
        "        flow = flow_audit.findings(using)",
        "        flow: list[str] = []",
        ("tests/misuse/test_attacks_flow.py::test_verifyworkflows_names_tampered_slots",),
    ),
    Mutant(
        "action-timeout-positive",
        "k2b_workflows/actions.py",
        "        or not 0 < timeout <= MAX_ACTION_TIMEOUT_S\n",
        "        or False\n",
        (
            "tests/kernel/test_flow.py::"
            "test_an_action_timeout_that_is_not_positive_seconds_is_refused_at_class_creation",
        ),
    ),
    Mutant(
        "workflow-timeout-bound",
        "k2b_workflows/workflows.py",
        "        if timeout > MAX_TIMEOUT:",
        "        if False:",
        ("tests/kernel/test_flow.py::test_a_malformed_declaration_is_refused_naming_its_field",),
    ),
    Mutant(
        "rate-limit-per-bound",
        "k2b_workflows/limits.py",
        "        if self.per > MAX_PER:",
        "        if False:",
        ("tests/kernel/test_flow.py::test_a_malformed_declaration_is_refused_naming_its_field",),
    ),
    Mutant(
        "key-page-bad-argument",
        "k2b_workflows/admin/views.py",
        '        if "\\x00" in value or len(value) > longest:',
        "        if False:",
        ("tests/kernel/test_flow.py::test_the_key_page_answers_400_naming_a_bad_argument",),
    ),
    Mutant(
        "slot-only-when-due",
        "k2b_workflows/migrations/0021_flow_guards.py",
        '           AND run_after <= "public".k2b_now()\n',
        "",
        ("tests/kernel/test_flow.py::test_a_keyed_run_after_holds_no_slot_before_it_is_due",),
    ),
    Mutant(
        "requeue-releases-the-holder",
        "k2b_workflows/kernel/requeue.py",
        "        parts.extend(_RELEASED)\n",
        "        pass\n",
        (
            "tests/crash/test_survive.py::"
            "test_a_hand_back_is_not_skipped_for_the_lease_keepers_own_renewal",
            "tests/kernel/test_requeue.py",
        ),
    ),
    Mutant(
        "housekeeping-admits-due-keyed-runs",
        "k2b_workflows/worker/housekeeping.py",
        "            if any(d.concurrency is not None for d in registered_versions()):",
        "            if False:",
        ("tests/kernel/test_flow.py::test_a_keyed_run_after_holds_no_slot_before_it_is_due",),
    ),
    Mutant(
        "ai-calls-from-charges",
        "k2b_workflows/kernel/budgets.py",
        "            used = cursor.fetchone()[0]",
        "            cursor.fetchone()",
        (
            "tests/misuse/test_attacks_flow.py::test_max_ai_calls_holds_whatever_the_ai_calls_counter_says",
        ),
    ),
    Mutant(
        "task-bulk-input-size",
        "k2b_workflows/tasks/backend.py",
        "                fits = len(text.encode()) <= self.room",
        "                fits = True",
        (
            "tests/tasks/test_misuse.py::"
            "test_enqueue_many_refuses_a_call_too_large_only_with_its_tasks_part_as_enqueue_does",
        ),
    ),
    Mutant(
        "task-result-end-seal",
        "k2b_workflows/tasks/backend.py",
        "            forged = seals.end_problem(run)\n",
        "            forged = None\n",
        (
            "tests/misuse/test_sealed_rows.py::"
            "test_a_tasks_get_result_refuses_an_end_the_runtime_role_wrote",
        ),
    ),
    Mutant(
        "task-attempt-seal",
        "k2b_workflows/tasks/runs.py",
        "    rows = sealed_attempts(run.pk, rows)\n",
        "    rows = list(rows)\n",
        (
            "tests/misuse/test_sealed_rows.py::"
            "test_a_task_attempt_the_runtime_role_inserted_is_never_shown_as_the_tasks_error",
        ),
    ),
    # The bad inputs of #47: each refused at the call, naming the argument.
    Mutant(
        "task-priority-is-an-int",
        "k2b_workflows/tasks/backend.py",
        "        _check_priority(task.priority, path)\n",
        "",
        (
            "tests/tasks/test_misuse.py::test_a_priority_that_is_not_an_int_is_refused_naming_priority",
        ),
    ),
    Mutant(
        "task-run-after-bound",
        "k2b_workflows/tasks/backend.py",
        "    if delay > MAX_RUN_AFTER:\n",
        "    if False:\n",
        ("tests/tasks/test_misuse.py::test_a_run_after_out_of_bounds_is_refused_naming_run_after",),
    ),
    Mutant(
        "task-run-after-delay",
        "k2b_workflows/tasks/backend.py",
        "        return _now() + value\n",
        "        return None\n",
        ("tests/tasks/test_misuse.py::test_a_run_after_timedelta_is_a_delay_from_the_enqueue",),
    ),
    Mutant(
        "task-call-binds",
        "k2b_workflows/tasks/backend.py",
        "        signature.bind(*args, **kwargs)\n",
        "        pass\n",
        (
            "tests/tasks/test_misuse.py::test_arguments_the_task_does_not_take_are_refused_at_the_call",
        ),
    ),
    Mutant(
        "task-call-binds-without-context",
        "k2b_workflows/tasks/backend.py",
        "    if takes_context:\n",
        "    if False:\n",
        ("tests/tasks/test_misuse.py::test_a_call_that_binds_is_taken_with_a_context_task_too",),
    ),
    Mutant(
        "task-is-a-task",
        "k2b_workflows/tasks/backend.py",
        "    if not isinstance(task, base_api.Task):\n",
        "    if False:\n",
        (
            "tests/tasks/test_misuse.py::"
            "test_a_function_or_a_path_in_place_of_a_task_is_refused_naming_task",
        ),
    ),
    Mutant(
        "task-queues-a-list",
        "k2b_workflows/tasks/backend.py",
        '        _check_queues(alias, params.get("QUEUES"))\n',
        "",
        (
            "tests/tasks/test_misuse.py::"
            "test_a_string_for_queues_is_an_improperly_configured_backend_naming_queues",
        ),
    ),
    Mutant(
        "task-schedule-input",
        "k2b_workflows/tasks/backend.py",
        "    if schedule.input:\n",
        "    if False:\n",
        (
            "tests/tasks/test_misuse.py::"
            "test_a_tasks_schedule_refuses_an_input_instead_of_dropping_it",
        ),
    ),
    # NF2, NF6 and N7 of #47.
    Mutant(
        "task-result-start-seal-first",
        "k2b_workflows/tasks/backend.py",
        "        unsealed = seals.start_problem(run)\n",
        "        unsealed = None\n",
        (
            "tests/misuse/test_sealed_rows.py::"
            "test_a_task_path_the_runtime_role_wrote_is_never_imported_by_a_reader",
        ),
    ),
    Mutant(
        "task-admin-path-start-seal",
        "k2b_workflows/admin/runs.py",
        "        problem = seals.start_problem(run)\n",
        "        problem = None\n",
        (
            "tests/misuse/test_sealed_rows.py::"
            "test_a_task_path_the_runtime_role_wrote_is_never_imported_by_a_reader",
        ),
    ),
    Mutant(
        "task-attempt-copy-once",
        "k2b_workflows/tasks/runs.py",
        "        original = first.get(row.seal) if problem is None else None\n",
        "        original = None\n",
        (
            "tests/misuse/test_sealed_rows.py::"
            "test_a_sealed_task_attempt_the_runtime_role_copied_counts_once_and_is_reported",
        ),
    ),
    Mutant(
        "witness-plain-check",
        "k2b_workflows/checks.py",
        "@register(Tags.security)\ndef check_witness(",
        "@register(Tags.security, deploy=True)\ndef check_witness(",
        ("tests/misuse/test_witness_check.py::test_a_plain_check_warns_too",),
    ),
    Mutant(
        "queue-pause-claim",
        "k2b_workflows/kernel/claim.py",
        "WHERE status = 'queued' AND {claimable} AND {not_paused}",
        "WHERE status = 'queued' AND {claimable}",
        (
            "tests/kernel/test_queue_pauses.py::"
            "test_a_paused_queues_runs_are_accepted_queued_and_not_claimed_while_others_run",
            "tests/worker/test_queue_pause.py::"
            "test_a_pause_stops_a_live_worker_claiming_and_holds_through_a_kill_and_a_restart",
        ),
    ),
    Mutant(
        "queue-pause-pending",
        "k2b_workflows/worker/selection.py",
        "OR {unadmitted_keyed}) AND {not_paused}",
        "OR {unadmitted_keyed})",
        (
            "tests/worker/test_queue_pause.py::"
            "test_a_burst_worker_ends_with_a_paused_queues_runs_still_queued",
        ),
    ),
    Mutant(
        "queue-pause-next-due",
        "k2b_workflows/kernel/claim.py",
        "WHERE status = 'queued' AND {flow.CLAIMABLE} AND {flow.NOT_PAUSED}\n"
        "        AND {flow.LINE} <= k2b_now()",
        "WHERE status = 'queued' AND {flow.CLAIMABLE}\n        AND {flow.LINE} <= k2b_now()",
        (
            "tests/kernel/test_queue_pauses.py::"
            "test_a_paused_queues_runs_are_accepted_queued_and_not_claimed_while_others_run",
        ),
    ),
    Mutant(
        "fair-line-from-the-head",
        "k2b_workflows/migrations/0036_fairness.py",
        'RETURN GREATEST(LEAST(head, "public".k2b_now()), last)',
        'RETURN GREATEST("public".k2b_now(), last)',
        (
            "tests/tasks/test_fairness.py::"
            "test_a_key_that_comes_back_goes_in_at_the_head_not_before_it",
            "tests/tasks/test_fairness.py::test_a_tenant_queued_behind_a_backlog_goes_next",
        ),
    ),
    Mutant(
        "fair-line-after-the-keys-last",
        "k2b_workflows/migrations/0036_fairness.py",
        'RETURN GREATEST(LEAST(head, "public".k2b_now()), last)',
        'RETURN LEAST(head, "public".k2b_now())',
        (
            "tests/tasks/test_fairness.py::test_a_heavier_key_takes_more_turns",
            "tests/tasks/test_fairness.py::test_keys_alternate_while_both_have_runs_queued",
        ),
    ),
    Mutant(
        "fair-line-index-walk",
        "k2b_workflows/migrations/0036_fairness.py",
        "SET enable_sort = off SET enable_seqscan = off SET enable_bitmapscan = off\n",
        "",
        (
            "tests/tasks/test_fairness.py::"
            "test_placing_each_run_reads_a_few_index_entries_however_long_the_backlog",
        ),
    ),
    Mutant(
        "fair-line-claimed",
        "k2b_workflows/kernel/flow.py",
        'LINE = "k2b_queue_order(COALESCE(fair_line, run_after), priority_credit_ms)"',
        'LINE = "k2b_queue_order(run_after, priority_credit_ms)"',
        ("tests/tasks/test_fairness.py::test_a_tenant_queued_behind_a_backlog_goes_next",),
    ),
    Mutant(
        "fair-key-sealed",
        "k2b_workflows/kernel/seals.py",
        '        fields.append(["fairness", fairness[0], float(fairness[1])])',
        "        pass",
        ("tests/tasks/test_fairness.py::test_a_rewritten_key_breaks_the_start_seal",),
    ),
    Mutant(
        "queue-resume-wakes-every-app",
        "k2b_workflows/worker/wakeups.py",
        "                            or note.payload == waits.EVERY_APP\n",
        "",
        (
            "tests/worker/test_queue_pause.py::"
            "test_a_resume_wakes_an_idle_worker_of_another_app_at_once",
        ),
    ),
    Mutant(
        "late-end-as-written-refused-by-its-fence",
        "k2b_workflows/kernel/ending.py",
        "            # By the fence (not ours any more), or by the check of the chains.\n"
        "            self.refuse_unless_ours(pending)\n",
        "",
        (
            "tests/kernel/test_canceled_ends.py::"
            "test_the_late_end_of_a_canceled_run_is_refused_once_and_says_what_became_of_the_result",
            "tests/tasks/test_canceled_calls.py::"
            "test_a_pure_task_canceled_under_its_call_ends_nothing_and_the_worker_goes_on",
        ),
    ),
    Mutant(
        "late-end-as-read-refused-by-its-fence",
        "k2b_workflows/kernel/ending.py",
        "            self.refuse_unless_ours(pending)\n"
        '            logger.info("run %s: batched end refused (%s)", self.run_id, exc)\n',
        '            logger.info("run %s: batched end refused (%s)", self.run_id, exc)\n',
        (
            "tests/kernel/test_canceled_ends.py::"
            "test_an_end_that_reads_its_chains_first_is_refused_by_its_fence_once",
        ),
    ),
    Mutant(
        "late-end-asks-on-the-abort-signal",
        "k2b_workflows/kernel/ending.py",
        "                if self.claim.canceled.is_set():\n",
        "                if False:\n",
        (
            "tests/kernel/test_canceled_ends.py::"
            "test_the_abort_signal_refuses_the_end_of_a_canceled_run_before_anything_is_sent",
        ),
    ),
    Mutant(
        "batched-writes-refused-by-their-fence",
        "k2b_workflows/kernel/journal.py",
        "            if lost is not None:\n                raise lost from None\n",
        "",
        (
            "tests/kernel/test_canceled_ends.py::"
            "test_a_batched_write_of_a_canceled_run_is_refused_by_its_fence_once",
        ),
    ),
    # Django's proposed task options (#49).
    Mutant(
        "task-max-attempts-bound",
        "k2b_workflows/tasks/options.py",
        "            max_attempts=attempts, backoff=backoff, max_backoff=backoff,",
        "            max_attempts=attempts + 1, backoff=backoff, max_backoff=backoff,",
        ("tests/tasks/test_django_options.py::test_max_attempts_bounds_the_calls_exactly",),
    ),
    Mutant(
        "task-retry-or-max-attempts",
        "k2b_workflows/tasks/options.py",
        '    if values["retry"] is not None and (attempts is not None or backoff is not None):',
        "    if False:",
        (
            "tests/tasks/test_django_options.py::"
            "test_bad_declarations_are_refused_naming_the_option_and_the_task",
        ),
    ),
    Mutant(
        "task-backoff-none-stops",
        "k2b_workflows/tasks/runs.py",
        "        if delay is None:\n",
        "        if False:\n",
        ("tests/tasks/test_django_options.py::test_a_backoff_that_returns_none_stops_the_retries",),
    ),
    Mutant(
        "task-backoff-delay",
        "k2b_workflows/kernel/ending.py",
        "        delay = retrying.delay_ms(policy, failures) if delay_ms is None else delay_ms\n",
        "        delay = retrying.delay_ms(policy, failures)\n",
        (
            "tests/tasks/test_django_options.py::"
            "test_a_backoff_function_is_asked_with_the_exception_and_the_result",
        ),
    ),
    Mutant(
        "failed-delay-kept",
        "k2b_workflows/actions.py",
        "            return Failed(message, result.code, result.retryable, delay)",
        "            return Failed(message, result.code, result.retryable)",
        (
            "tests/tasks/test_django_options.py::"
            "test_a_backoff_function_is_asked_with_the_exception_and_the_result",
        ),
    ),
    Mutant(
        "task-timeout-late-answer",
        "k2b_workflows/tasks/runs.py",
        "        if limit is not None and clock.monotonic() - started > limit:\n"
        '            raise TaskTimeout(input["task"], limit, clock.monotonic() - started)\n',
        "",
        (
            "tests/tasks/test_django_options.py::"
            "test_a_pure_call_past_its_timeout_fails_with_task_timeout_and_is_retried",
            "tests/tasks/test_django_options.py::"
            "test_an_external_call_past_its_timeout_is_an_unknown_outcome_never_called_again",
        ),
    ),
    Mutant(
        "task-timeout-async",
        "k2b_workflows/tasks/runs.py",
        "                value = hooks.run_coroutine(value, ctx.abort, limit, asked=asked)",
        "                value = hooks.run_coroutine(value, ctx.abort, asked=asked)",
        ("tests/tasks/test_django_options.py::test_an_async_call_is_cancelled_at_its_timeout",),
    ),
    Mutant(
        "task-timeout-external-unknown",
        "k2b_workflows/tasks/runs.py",
        "            if isinstance(exc, TaskTimeout) and type(self).effect.is_external:",
        "            if False:",
        (
            "tests/tasks/test_django_options.py::"
            "test_an_external_call_past_its_timeout_is_an_unknown_outcome_never_called_again",
        ),
    ),
    Mutant(
        "progress-throttled",
        "k2b_workflows/kernel/progress.py",
        "MIN_INTERVAL_S = 0.25\n",
        "MIN_INTERVAL_S = 0.0\n",
        (
            "tests/tasks/test_progress.py::"
            "test_two_thousand_calls_in_a_loop_write_a_few_times_and_keep_the_last_value",
        ),
    ),
    Mutant(
        "progress-last-value-written-at-the-steps-end",
        "k2b_workflows/kernel/progress.py",
        "        if writer.has_pending(self.key):\n            writer.flush(self.key)\n",
        "",
        (
            "tests/tasks/test_progress.py::"
            "test_the_last_value_is_written_at_the_steps_end_not_when_the_interval_passes",
        ),
    ),
    Mutant(
        "progress-in-a-transaction-of-its-own",
        "k2b_workflows/progress.py",
        "    writer.record(ctx, done, total, note, clock.now())\n",
        "    RunProgress.objects.using(ctx.using).update_or_create(\n"
        "        run_id=ctx.run_id,\n"
        "        defaults={'generation': ctx.generation, 'done': done, 'total': total,\n"
        "                  'note': note, 'updated_at': clock.now()},\n"
        "    )\n",
        (
            "tests/tasks/test_progress.py::"
            "test_a_transactional_step_that_rolls_back_keeps_its_progress",
        ),
    ),
    Mutant(
        "fork-refuses-effects-that-may-have-happened",
        "k2b_workflows/kernel/forks.py",
        "        if refused:\n            raise ForkRefused(run_id, refused)\n",
        "",
        (
            "tests/kernel/test_fork.py::"
            "test_an_external_step_after_the_fork_point_refuses_the_fork",
            "tests/kernel/test_fork.py::test_a_children_step_whose_children_paid_refuses_the_fork",
            "tests/kernel/test_fork.py::test_a_fork_of_an_external_task_call_that_ran_is_refused",
        ),
    ),
    Mutant(
        "fork-keeps-the-originals-idempotent-keys",
        "k2b_workflows/kernel/execute.py",
        "            ctx.effect_key = forks.key_for("
        "self.inherited_keys, seq, name, ctx.effect_key)\n",
        "            pass\n",
        (
            "tests/kernel/test_fork.py::"
            "test_an_idempotent_step_runs_again_with_the_originals_effect_key",
            "tests/crash/test_fork_crash.py::"
            "test_sigkill_in_a_forks_idempotent_step_repeats_it_under_the_originals_key",
        ),
    ),
    Mutant(
        "fork-only-a-run-that-ended",
        "k2b_workflows/kernel/forks.py",
        "    if original.status not in FORKABLE_STATUSES:\n",
        "    if False:\n",
        ("tests/kernel/test_fork.py::test_a_run_that_may_still_act_is_not_forked",),
    ),
    Mutant(
        "fork-link-sealed",
        "k2b_workflows/kernel/seals.py",
        "    if forked_from is not None:\n",
        "    if False:\n",
        (
            "tests/kernel/test_fork.py::test_a_fork_is_linked_both_ways_and_verifies_as_any_run",
            "tests/misuse/test_sealed_rows.py::"
            "test_a_fork_link_rewritten_by_the_runtime_role_is_refused_at_its_claim",
        ),
    ),
    Mutant(
        "fork-copies-a-failure-as-a-failure",
        "k2b_workflows/kernel/forks.py",
        '                    "state": entry.state,\n',
        '                    "state": JournalEntry.State.SUCCEEDED,\n',
        ("tests/kernel/test_fork.py::test_a_failure_before_the_fork_point_stays_a_failure",),
    ),
    Mutant(
        "settle-skips-runs-not-waiting",
        "k2b_workflows/admin/settle.py",
        "    eligible = [run for run in runs if not settle_refusal(run)]\n",
        "    eligible = list(runs)\n",
        (
            "tests/admin/test_settle_incidents.py::"
            "test_a_run_not_waiting_for_a_decision_is_skipped_with_why",
        ),
    ),
    Mutant(
        "settle-capped",
        "k2b_workflows/admin/settle.py",
        "    if selected > MAX_SETTLE:\n",
        "    if False:\n",
        ("tests/admin/test_settle_incidents.py::test_a_selection_above_the_cap_resolves_nothing",),
    ),
    Mutant(
        "settle-each-run-on-the-evidence-shown",
        "k2b_workflows/admin/settle.py",
        "                seen_ledger_id=shown.ledger_id,\n",
        "                seen_ledger_id=None,\n",
        (
            "tests/admin/test_settle_incidents.py::"
            "test_a_run_whose_evidence_changed_after_the_confirmation_is_refused_alone",
        ),
    ),
    Mutant(
        "settle-needs-a-token-for-each-run",
        "k2b_workflows/admin/settle.py",
        "    if missing:\n",
        "    if False:\n",
        (
            "tests/admin/test_settle_incidents.py::test_a_malformed_confirmation_resolves_nothing_and_says_why",
        ),
    ),
    Mutant(
        "keyless-task-shows-no-effect-key",
        "k2b_workflows/templates/admin/k2b_workflows/resolve.html",
        "{% if effect_key.used is False %}",
        "{% if False %}",
        (
            "tests/admin/test_incident_display.py::"
            "test_a_keyless_tasks_form_shows_its_arguments_and_no_effect_key",
        ),
    ),
    Mutant(
        "incident-queue-reads-small-inputs-only",
        "k2b_workflows/admin/display.py",
        """'CASE WHEN pg_column_size("k2b_run"."input") > %s THEN NULL'\n""",
        """'CASE WHEN %s < 0 THEN NULL'\n""",
        (
            "tests/admin/test_admin_hardening.py::"
            "test_journal_ledger_and_incident_lists_never_read_the_runs_json_bodies",
        ),
        also=(
            (
                """' WHEN octet_length("k2b_run"."input"::text) > %s THEN NULL'\n""",
                """' WHEN %s < 0 THEN NULL'\n""",
            ),
        ),
    ),
    Mutant(
        "incident-story-a-worker-that-beat-again-did-not-die",
        "k2b_workflows/incidents.py",
        "    if taken_at is not None and holder.heartbeat_at > taken_at:\n",
        "    if False:\n",
        (
            "tests/crash/test_incident_story.py::"
            "test_a_worker_killed_inside_an_external_call_is_named_and_said_to_have_died",
        ),
    ),
    Mutant(
        "task-retry-one-more-call-per-retry",
        "k2b_workflows/tasks/runs.py",
        "            if failures >= granted:\n",
        "            if failures > granted:\n",
        (
            "tests/tasks/test_retry_failed.py::"
            "test_a_call_that_fails_again_is_failed_again_and_can_be_retried_again",
        ),
    ),
    Mutant(
        "task-retry-attempts-go-on",
        "k2b_workflows/tasks/runs.py",
        "    return earlier + run.consecutive_failures + 1\n",
        "    return run.consecutive_failures + 1\n",
        ("tests/tasks/test_retry_failed.py::test_the_retried_call_sees_its_attempt_number_go_on",),
    ),
    Mutant(
        "incident-story-takeover-only-of-a-lost-lease",
        "k2b_workflows/incidents.py",
        "    if holder_id and holder_id in lost_by:\n",
        "    if holder_id:\n",
        (
            "tests/crash/test_incident_story.py::"
            "test_a_worker_killed_inside_an_external_call_is_named_and_said_to_have_died",
        ),
    ),
    Mutant(
        "unique-key-written",
        "k2b_workflows/kernel/starts.py",
        "        columns.update(unique.columns)",
        "        pass",
        (
            "tests/tasks/test_unique.py::test_a_call_whose_key_a_run_holds_returns_that_run_and_inserts_nothing",
            "tests/tasks/test_unique.py::test_two_calls_in_concurrent_transactions_give_one_run",
        ),
    ),
    Mutant(
        "unique-period-fresh-holder-kept",
        "k2b_workflows/kernel/uniques.py",
        "    if period is not None and found.created_at <= now - period:",
        "    if period is not None:",
        ("tests/tasks/test_unique.py::test_a_run_enqueued_a_period_ago_or_more_lets_its_key_go",),
    ),
    Mutant(
        "unique-running-never-changed",
        "k2b_workflows/kernel/uniques.py",
        '    return run.status == "queued" and run.generation == 0',
        '    return run.status in ("queued", "running")',
        ("tests/tasks/test_unique.py::test_a_running_run_is_never_changed",),
        also=(
            (
                'filter(pk=locked.pk, status="queued", generation=0)',
                "filter(pk=locked.pk)",
            ),
        ),
    ),
    Mutant(
        "unique-holder-seal-checked",
        "k2b_workflows/kernel/uniques.py",
        "    problem = seals.start_problem(locked)",
        "    problem = None",
        ("tests/tasks/test_unique.py::test_a_holder_whose_seal_is_broken_is_not_resealed",),
    ),
    Mutant(
        "unique-replace-resealed",
        "k2b_workflows/kernel/uniques.py",
        "    locked.start_seal = seals.start_seal(locked)",
        "    pass",
        (
            "tests/tasks/test_unique.py::test_replace_gives_a_ready_run_the_calls_arguments_priority_and_run_after",
            "tests/tasks/test_unique.py::test_a_replaced_run_runs_with_the_last_calls_arguments",
        ),
    ),
    Mutant(
        "unique-debounce-max-wait",
        "k2b_workflows/kernel/uniques.py",
        "            until = min(until, locked.created_at + unique.max_wait)",
        "            pass",
        (
            "tests/tasks/test_unique.py::test_debounce_moves_a_ready_runs_start_never_past_its_max_wait",
        ),
    ),
    Mutant(
        "unique-retry-keeps-key-let-go",
        "k2b_workflows/kernel/interventions.py",
        "        \"CASE WHEN status IN ('failed', 'canceled') AND unique_states NOT IN (4, 5)\"",
        '        "CASE WHEN false"',
        (
            "tests/tasks/test_unique.py::test_a_retried_failed_run_that_let_its_key_go_does_not_take_it_back",
        ),
    ),
    Mutant(
        "unique-key-binds-signature",
        "k2b_workflows/tasks/backend.py",
        "        binding.apply_defaults()\n        bound = dict(binding.arguments)",
        '        bound = {"args": args, "kwargs": kwargs}',
        (
            "tests/tasks/test_unique.py::test_a_call_whose_key_a_run_holds_returns_that_run_and_inserts_nothing",
            "tests/tasks/test_unique.py::test_without_keys_every_argument_bound_with_its_defaults_is_the_key",
        ),
    ),
    Mutant(
        "cancel-no-further-attempt",
        "k2b_workflows/kernel/execute.py",
        "            if run.cancel_requested_at is not None:\n",
        "            if False:\n",
        (
            "tests/tasks/test_cancel.py::test_a_call_whose_worker_is_killed_after_the_request_is_not_run_again",
        ),
        # Its backstop: the step the takeover would start stops the run too.
        also=((_STOPS_THE_NEXT_STEP, _STARTS_THE_NEXT_STEP),),
    ),
    Mutant(
        # cancel_workflow_run of a running run (#49): its step finishes, the next never starts.
        "cancel-stops-the-next-step",
        "k2b_workflows/kernel/execute.py",
        _STOPS_THE_NEXT_STEP,
        _STARTS_THE_NEXT_STEP,
        (
            "tests/worker/test_cancel_running_runs.py::"
            "test_a_running_run_is_asked_its_step_commits_and_the_next_never_starts",
        ),
    ),
    Mutant(
        "cancel-no-retry",
        "k2b_workflows/kernel/ending.py",
        "        if self.claim.cancel_requested.is_set():\n            # A canceled call is never",
        "        if False:\n            # A canceled call is never",
        (
            "tests/tasks/test_cancel.py::test_a_call_that_raises_after_the_request_fails_as_canceled_and_is_never_retried[retried]",
        ),
    ),
    Mutant(
        "cancel-failure-ends-canceled",
        "k2b_workflows/kernel/ending.py",
        "        if self.claim.cancel_requested.is_set():\n"
        "            # Asked to stop, then failed",
        "        if False:\n            # Asked to stop, then failed",
        (
            "tests/tasks/test_cancel.py::test_a_call_that_raises_after_the_request_fails_as_canceled_and_is_never_retried[not]",
        ),
    ),
    Mutant(
        "cancel-read-on-failure",
        "k2b_workflows/tasks/runs.py",
        "            ctx.cancel_asked(read=True)\n",
        "",
        (
            "tests/tasks/test_cancel.py::test_a_call_that_raises_after_the_request_fails_as_canceled_and_is_never_retried[retried]",
            "tests/tasks/test_cancel.py::test_a_call_that_raises_after_the_request_fails_as_canceled_and_is_never_retried[not]",
        ),
    ),
    Mutant(
        "cancel-keeper-asks",
        "k2b_workflows/kernel/leases.py",
        "            self._asked(runs, asked)\n",
        "",
        (
            "tests/tasks/test_cancel.py::test_a_running_call_is_asked_within_a_second_and_its_return_is_its_result",
        ),
        also=(("            self._asked(runs, {r[0] for r in rows if r[3]})\n", ""),),
    ),
    Mutant(
        "cancel-async-asked",
        "k2b_workflows/kernel/hooks.py",
        "            task.cancel()\n            asked = None",
        "            asked = None",
        (
            "tests/tasks/test_cancel.py::test_an_async_pure_call_gets_cancelled_error_at_its_next_await",
        ),
    ),
    Mutant(
        "cancel-calls-cap",
        "k2b_workflows/admin/views.py",
        "    if spec.cap is not None and selected > spec.cap:\n",
        "    if False:\n",
        (
            "tests/tasks/test_cancel.py::test_the_admin_refuses_to_cancel_more_task_calls_than_its_cap",
        ),
    ),
    Mutant(
        "cancel-external-never-cut",
        "k2b_workflows/tasks/runs.py",
        "            asked = None if external else ctx.cancel_requested\n",
        "            asked = ctx.cancel_requested\n",
        ("tests/tasks/test_cancel.py::test_an_async_external_call_is_asked_and_never_cut",),
    ),
    Mutant(
        "batch-callback-idempotency-key",
        "k2b_workflows/kernel/batches.py",
        "                idempotency_key=callback_key(batch_id, name),\n",
        "",
        (
            "tests/tasks/test_batches.py::"
            "test_a_finished_mark_cleared_by_hand_enqueues_no_callback_again",
        ),
    ),
    Mutant(
        "batch-unfinished-asked-under-the-lock",
        "k2b_workflows/kernel/batches.py",
        "        if db.fetchall(using, UNFINISHED_SQL, [str(batch_id)] * len(_UNFINISHED))"
        "[0][0]:\n",
        "        if False:\n",
        (
            "tests/tasks/test_batches.py::"
            "test_no_callback_while_a_member_needs_an_operator_and_once_it_is_resolved",
        ),
    ),
    Mutant(
        "batch-member-needing-attention-unfinished",
        "k2b_workflows/kernel/batches.py",
        '_UNFINISHED = ("queued", "running", "waiting", "needs_attention")',
        '_UNFINISHED = ("queued", "running", "waiting")',
        (
            "tests/tasks/test_batches.py::"
            "test_no_callback_while_a_member_needs_an_operator_and_once_it_is_resolved",
        ),
    ),
    Mutant(
        "batch-running-member-unfinished",
        "k2b_workflows/kernel/batches.py",
        '_UNFINISHED = ("queued", "running", "waiting", "needs_attention")',
        '_UNFINISHED = ("queued", "waiting", "needs_attention")',
        (
            "tests/crash/test_batch_restarts.py::"
            "test_a_batch_drained_through_database_restarts_runs_each_callback_once_after_its_members",
        ),
    ),
    Mutant(
        "batch-callbacks-sealed",
        "k2b_workflows/kernel/batches.py",
        "        if problem is not None:\n",
        "        if False:\n",
        ("tests/tasks/test_batches.py::test_a_callback_changed_in_the_batch_row_is_refused",),
    ),
    Mutant(
        "retention-keeps-members-of-open-batches",
        "k2b_workflows/retention.py",
        "                           OR (d.input ? 'batch' AND EXISTS (\n",
        "                           OR (FALSE AND EXISTS (\n",
        (
            "tests/tasks/test_batches.py::"
            "test_members_of_a_batch_whose_callbacks_wait_are_kept_whatever_their_age",
        ),
    ),
    Mutant(
        "retention-batch-kept-while-a-member-is-left",
        "k2b_workflows/retention.py",
        "                    WHERE {batches.MEMBER_OF.format(batch="
        '"b.id::text")} AND id <> ALL(%s))',
        "                    WHERE FALSE AND id <> ALL(%s))",
        ("tests/tasks/test_batches.py::test_a_batch_stays_while_one_of_its_runs_is_left",),
    ),
    Mutant(
        "retention-batch-kept-while-a-callback-run-is-left",
        "k2b_workflows/retention.py",
        "                      AND cr.id <> ALL(%s))",
        "                      AND FALSE AND cr.id <> ALL(%s))",
        ("tests/tasks/test_batches.py::test_a_batch_stays_while_one_of_its_runs_is_left",),
    ),
    Mutant(
        "retention-batch-id-text-matched-before-cast",
        "k2b_workflows/retention.py",
        "f\"CASE WHEN d.input ->> 'batch' ~ {_UUID_TEXT} THEN (d.input ->> 'batch')::uuid END\"",
        "\"(d.input ->> 'batch')::uuid\"",
        (
            "tests/tasks/test_batches.py::"
            "test_a_batch_id_that_is_not_a_uuid_in_a_row_does_not_stop_the_purge",
        ),
    ),
    Mutant(
        "retention-callback-run-id-text-matched-before-cast",
        "k2b_workflows/retention.py",
        "SELECT CASE WHEN c.value ~ {_UUID_TEXT} THEN c.value::uuid END",
        "SELECT c.value::uuid",
        (
            "tests/tasks/test_batches.py::"
            "test_a_batch_id_that_is_not_a_uuid_in_a_row_does_not_stop_the_purge",
        ),
    ),
    Mutant(
        "burst-worker-last-batch-pass",
        "k2b_workflows/worker/loop.py",
        "            return not self.housekeeping.run(0)\n",
        "            return True\n",
        (
            "tests/tasks/test_batches.py::"
            "test_a_burst_worker_enqueues_and_runs_the_callbacks_of_the_batch_it_drained",
        ),
    ),
)


#: Files whose mutants change what ``migrate`` installs (migrations, the trigger
#: and function bodies they import, the models they name), the grants, the clock
#: function the tests swap, or the test database's own setup and flush. Their
#: mutants never run on a kept database.
SCHEMA_PREFIXES = ("k2b_workflows/migrations/", "k2b_workflows/models/")
SCHEMA_FILES = frozenset(
    {
        "k2b_workflows/apps.py",
        "k2b_workflows/kernel/clock.py",
        "k2b_workflows/roles.py",
        "k2b_workflows/testdb.py",
        "k2b_workflows/triggers.py",
    }
)


def touches_schema(mutant: Mutant) -> bool:
    return mutant.path in SCHEMA_FILES or mutant.path.startswith(SCHEMA_PREFIXES)


def _copy_tree(dest: Path) -> None:
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, files):
        source = ROOT / os.fsdecode(name)
        if source.is_file():
            target = dest / os.fsdecode(name)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def _apply(tree: Path, mutant: Mutant) -> str:
    path = tree / mutant.path
    text = original = path.read_text()
    for old, new in ((mutant.old, mutant.new), *mutant.also):
        count = text.count(old)
        if count != 1:
            raise SystemExit(
                f"mutant {mutant.name}: the guarded text occurs {count} times in "
                f"{mutant.path}; update scripts/mutants.py"
            )
        text = text.replace(old, new)
    _write(path, text)
    return original


def _write(path: Path, text: str) -> None:
    """Write a module and drop its cached bytecode: a mutant as long as the guard
    it replaced, written within the same second, would otherwise load from the
    other's ``.pyc`` (checked by size and whole-second mtime)."""
    path.write_text(text)
    for cached in (path.parent / "__pycache__").glob(f"{path.stem}.*.pyc"):
        cached.unlink(missing_ok=True)


def _own_database(url: str, suffix: str) -> str:
    """``url`` with ``_mutants<suffix>`` added to the database name: the test database
    pytest creates from it (``test_<name>_mutants<suffix>``) is neither the one a
    ``make test`` beside this run creates and drops, nor another job's."""
    parts = urlsplit(url)
    name = parts.path.lstrip("/") or "postgres"
    return urlunsplit(parts._replace(path=f"/{name}_mutants{suffix}"))


@dataclass
class Job:
    """A copy of the tree and the test database kept for its mutants."""

    number: int
    tree: Path
    #: Whether the kept database must be made anew: before the first mutant (one
    #: left by an earlier run may be of other migrations), and after a hang, whose
    #: killed session may have left the test clock's function installed.
    fresh: bool = True

    def database_url(self, schema: bool) -> str:
        """The URL its mutants' tests get: the kept database's, or (``schema``) that
        of one pytest-django creates for a single mutant and drops after it."""
        suffix = f"{self.number}s" if schema else str(self.number)
        return _own_database(os.environ["DATABASE_URL"], suffix)


def _pytest(job: Job, targets: list[str], timeout: float, schema: bool) -> tuple[int, str]:
    env = {
        **os.environ,
        # A supervisor's mutant shows as a wait that never ends: wait less for it.
        "K2B_PROCESS_TEST_TIMEOUT": os.environ.get("K2B_PROCESS_TEST_TIMEOUT", "40"),
    }
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # the job's copy keeps its bytecode
    env["DATABASE_URL"] = job.database_url(schema)
    # A schema mutant's database is created for it and dropped after it (pytest-django's
    # default); the kept one is reused, and made anew when the job says so.
    databases: list[str] = []
    if not schema:
        databases = ["--reuse-db", "--create-db"] if job.fresh else ["--reuse-db"]
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-x",
        "-q",
        "-m",
        "not browser",
        *databases,
        *targets,
    ]
    try:
        done = subprocess.run(
            command, cwd=job.tree, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        done = None
    if not schema:
        job.fresh = done is None
    if done is None:
        return 1, "timed out: 1 failed (a hang counts as caught)"
    tail = (done.stdout + done.stderr).strip().splitlines()
    return done.returncode, tail[-1] if tail else ""


def _drop_kept(job: Job) -> None:
    """Drop the test database a job kept, as pytest-django drops the ones it made."""
    parts = urlsplit(job.database_url(schema=False))
    kept = "test_" + parts.path.lstrip("/")
    server = urlunsplit(parts._replace(path="/postgres"))
    with psycopg.connect(server, autocommit=True) as connection:
        connection.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(kept))
        )


def _run(mutant: Mutant, job: Job, args: argparse.Namespace) -> tuple[bool, str]:
    """Apply ``mutant`` to the job's own copy of the tree, run its tests, restore the file."""
    original = _apply(job.tree, mutant)
    started = time.monotonic()
    try:
        if args.full:
            targets = ["-m", "not crash and not slow and not browser", "tests"]
        else:
            targets = list(mutant.tests)
        code, last = _pytest(job, targets, args.timeout, touches_schema(mutant))
    finally:
        _write(job.tree / mutant.path, original)
    # Caught: a test failed. Only errors (setup, collection, the database),
    # or no test at all (exit 5), is no verdict, and is reported as such.
    caught = code == 1 and " failed" in last
    verdict = "caught" if caught else ("SURVIVED" if code == 0 else "NO VERDICT")
    line = (
        f"{mutant.name:26} {verdict:10} "
        f"{time.monotonic() - started:7.1f}  {' '.join(mutant.tests)}: {last}"
    )
    return caught, line


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument(
        "--full", action="store_true", help="run the whole fast suite against each mutant"
    )
    parser.add_argument("--timeout", type=float, default=900, help="seconds per mutant")
    parser.add_argument(
        "--jobs",
        type=int,
        default=int(os.environ.get("MUTANTS_JOBS", "3")),
        help="mutants run at once, each in a copy of the tree and a database of its own "
        "(most of a mutant's time is spent waiting on PostgreSQL and worker processes)",
    )
    args = parser.parse_args()
    if not os.environ.get("DATABASE_URL"):
        print("DATABASE_URL is not set (run it through 'make mutants')", file=sys.stderr)
        return 2
    chosen = [m for m in MUTANTS if not args.names or m.name in args.names]
    unknown = set(args.names) - {m.name for m in MUTANTS}
    if unknown:
        print(f"unknown mutants: {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    jobs = max(1, min(args.jobs, len(chosen)))
    survivors = []
    with tempfile.TemporaryDirectory(prefix="k2b-mutants-") as tmp:
        idle: queue.Queue[Job] = queue.Queue()
        for number in range(jobs):
            job = Job(number, Path(tmp) / str(number))
            _copy_tree(job.tree)
            # Every guarded text occurs once before anything runs: a stale table
            # fails at once, not after an hour of the others.
            for mutant in chosen:
                _apply(job.tree, mutant)
                _write(job.tree / mutant.path, (ROOT / mutant.path).read_text())
            idle.put(job)

        def one(mutant: Mutant) -> tuple[Mutant, bool, str]:
            job = idle.get()
            try:
                return (mutant, *_run(mutant, job, args))
            finally:
                idle.put(job)

        print(f"{'mutant':26} {'result':10} {'seconds':>7}  tests", flush=True)
        try:
            with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
                for mutant, caught, line in pool.map(one, chosen):
                    print(line, flush=True)
                    if not caught:
                        survivors.append(mutant.name)
        finally:
            while not idle.empty():
                _drop_kept(idle.get())
    if survivors:
        print(f"\n{len(survivors)} mutant(s) not caught: {', '.join(survivors)}")
        return 1
    print(f"\nall {len(chosen)} mutants caught")
    return 0


if __name__ == "__main__":
    sys.exit(main())
