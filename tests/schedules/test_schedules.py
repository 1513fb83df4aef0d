"""Schedules (#24) on the controlled clock: ticks, catch-up, pause, overlap, DST, bad input.

Every test drives the passes the way a user's test would: ``controlled_clock``
moves ``k2b_now()``, ``run_until_idle`` fires the due ticks and runs their
runs. The fleet (real workers, SIGKILL, a PostgreSQL restart) is
tests/schedules/test_schedules_fleet.py.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from zoneinfo import ZoneInfo

import pytest
from django.core.management import call_command
from django.db import connection

from k2b_workflows import (
    InvalidSchedule,
    Schedule,
    UnknownWorkflow,
    schedule_workflow,
    workflow,
    workflows,
)
from k2b_workflows.kernel import schedule_passes, schedule_seals
from k2b_workflows.models import WorkflowRun, WorkflowSchedule, WorkflowScheduleSkip
from k2b_workflows.schedules import iso
from k2b_workflows.scheduling import (
    REMOVED_FROM_DECORATOR,
    run_schedule_now,
    sync_decorator_schedules,
)
from k2b_workflows.testing import run_until_idle
from tests.workflows.schedules import release

pytest_plugins = ["k2b_workflows.pytest_plugin"]
pytestmark = pytest.mark.django_db(transaction=True)

UTC = dt.UTC
QUICK = 30


def runs(schedule_id: str) -> list[WorkflowRun]:
    return list(WorkflowRun.objects.filter(schedule_id=schedule_id).order_by("scheduled_for"))


def ticks(schedule_id: str) -> list[dt.datetime]:
    return [r.scheduled_for for r in runs(schedule_id)]


def row(schedule_id: str) -> WorkflowSchedule:
    return WorkflowSchedule.objects.get(schedule_id=schedule_id)


def skips(schedule_id: str) -> list[tuple[str, int]]:
    return [
        (s.reason, s.count)
        for s in WorkflowScheduleSkip.objects.filter(schedule__schedule_id=schedule_id).order_by(
            "id"
        )
    ]


def db_now() -> dt.datetime:
    with connection.cursor() as cursor:
        cursor.execute("SELECT k2b_now()")
        return cursor.fetchone()[0]


# -- a tick, a run ------------------------------------------------------------


def test_the_first_tick_comes_after_the_schedule_is_created(k2b_clock):
    k2b_clock.advance(days=3)
    before = db_now()
    schedule = schedule_workflow("hourly", "sched.echo", Schedule(every=dt.timedelta(hours=1)))

    assert before <= schedule.anchor <= db_now()
    assert schedule.next_tick == schedule.anchor + dt.timedelta(hours=1)
    run_until_idle(timeout=QUICK)
    assert runs("hourly") == []


def test_a_due_tick_starts_one_run_with_its_key_input_and_tick(k2b_clock):
    k2b_clock.advance(days=1)
    schedule = schedule_workflow(
        "digest-42", "sched.echo", Schedule(every=dt.timedelta(minutes=5), input={"tenant": 42})
    )
    tick = schedule.next_tick

    k2b_clock.advance(minutes=5)
    stats = run_until_idle(timeout=QUICK)
    run_until_idle(timeout=QUICK)

    (run,) = runs("digest-42")
    assert stats["scheduled"] == 1 and stats["succeeded"] == 1
    assert run.scheduled_for == tick
    assert run.idempotency_key == f"schedule:digest-42:{tick.astimezone(UTC).isoformat()}"
    assert run.input == {"tenant": 42, "scheduled_for": iso(tick)}
    assert run.output == {"scheduled_for": iso(tick)}
    assert (run.status, run.schedule_id) == ("succeeded", "digest-42")
    moved = row("digest-42")
    assert (moved.last_tick, moved.last_run_id) == (tick, run.pk)
    assert moved.next_tick == tick + dt.timedelta(minutes=5)


def test_every_ticks_are_exactly_every_apart_from_the_anchor(k2b_clock):
    schedule = schedule_workflow(
        "every-90s", "sched.echo", Schedule(every=dt.timedelta(seconds=90))
    )
    for _ in range(4):
        k2b_clock.advance(seconds=90)
        run_until_idle(timeout=QUICK)

    assert ticks("every-90s") == [
        schedule.anchor + n * dt.timedelta(seconds=90) for n in range(1, 5)
    ]


def test_jitter_delays_each_tick_by_the_same_amount_on_every_worker(k2b_clock):
    from k2b_workflows.schedules import jitter_for

    schedule = schedule_workflow(
        "jittered",
        "sched.echo",
        Schedule(every=dt.timedelta(minutes=10), jitter=dt.timedelta(minutes=5)),
    )
    delay = schedule.next_fire_at - schedule.next_tick
    assert dt.timedelta(0) <= delay < dt.timedelta(minutes=5)
    assert delay == jitter_for("jittered", schedule.next_tick, dt.timedelta(minutes=5))
    ten = [
        jitter_for(
            "jittered", schedule.next_tick + n * dt.timedelta(minutes=10), dt.timedelta(minutes=5)
        )
        for n in range(10)
    ]
    assert len(set(ten)) > 1  # spread, not one fixed offset

    k2b_clock.advance_to(schedule.next_fire_at - dt.timedelta(seconds=1))
    run_until_idle(timeout=QUICK)
    assert runs("jittered") == []
    k2b_clock.advance(seconds=2)
    run_until_idle(timeout=QUICK)
    (run,) = runs("jittered")
    assert run.scheduled_for == schedule.next_tick  # the tick, not the jittered moment


def test_a_rewound_schedule_row_starts_no_second_run_for_a_tick(k2b_clock):
    """The backstop: the run's key is unique, so a pass from an old row state inserts nothing."""
    schedule_workflow("rewound", "sched.echo", Schedule(every=dt.timedelta(minutes=1)))
    restored = WorkflowSchedule.objects.filter(schedule_id="rewound").values().get()
    k2b_clock.advance(minutes=1)
    run_until_idle(timeout=QUICK)
    (first,) = runs("rewound")

    # As a restored backup leaves it: the row as the key holder wrote it (seal and
    # all) before the tick fired, the fired tick due again. (A hand edit of the tick
    # breaks the seal: tests/misuse/test_sealed_rows.py.)
    WorkflowSchedule.objects.filter(schedule_id="rewound").update(**restored)
    run_until_idle(timeout=QUICK)

    assert [r.pk for r in runs("rewound")] == [first.pk]
    assert row("rewound").next_tick == first.scheduled_for + dt.timedelta(minutes=1)


def test_a_pass_that_dies_before_its_commit_fired_nothing_and_the_next_fires_the_tick_once(
    k2b_clock, monkeypatch
):
    """A pass killed mid-way (its run inserted, its commit never sent) leaves the tick due:
    meanwhile the other workers' passes skip the locked row rather than wait or fire it."""
    from django.db import connections

    from k2b_workflows.kernel import starts

    start = starts.start
    schedule_workflow("mid-pass", "sched.echo", Schedule(every=dt.timedelta(minutes=1)))
    k2b_clock.advance(minutes=1)
    inserted, die = threading.Event(), threading.Event()

    class Killed(BaseException):
        pass

    def start_then_die(*args, **kwargs):
        start(*args, **kwargs)
        inserted.set()
        die.wait(QUICK)
        raise Killed

    def dying_pass():
        try:
            schedule_passes.run_pass("default", {"sched.echo": {1}})
        except Killed:
            pass
        finally:
            connections.close_all()

    monkeypatch.setattr(starts, "start", start_then_die)
    thread = threading.Thread(target=dying_pass)
    thread.start()
    try:
        assert inserted.wait(QUICK)
        monkeypatch.setattr(starts, "start", start)
        with connection.cursor() as cursor:
            cursor.execute("SET lock_timeout = '5s'")
        assert schedule_passes.run_pass("default", {"sched.echo": {1}}).rows == 0
        assert runs("mid-pass") == []
    finally:
        die.set()
        thread.join(QUICK)
    run_until_idle(timeout=QUICK)

    assert len(runs("mid-pass")) == 1


def test_a_schedule_that_cannot_fire_is_disabled_and_holds_back_no_other(k2b_clock, settings):
    every = dt.timedelta(minutes=1)
    schedule_workflow("too-big", "sched.echo", Schedule(every=every, input={"blob": "x" * 500}))
    schedule_workflow("fine", "sched.echo", Schedule(every=every))
    settings.K2B_WORKFLOWS = {**settings.K2B_WORKFLOWS, "MAX_VALUE_BYTES": 200}
    k2b_clock.advance(minutes=1)
    run_until_idle(timeout=QUICK)

    assert len(runs("fine")) == 1 and runs("too-big") == []
    disabled = row("too-big")
    assert not disabled.enabled and "MAX_VALUE_BYTES" in disabled.disabled_reason


def resealed(schedule: WorkflowSchedule) -> None:
    """Seal ``schedule``'s stored row as it is, as only a holder of the evidence key can."""
    WorkflowSchedule.objects.filter(pk=schedule.pk).update(
        seal=schedule_seals.seal(schedule.sealed_values())
    )


# -- catch-up ---------------------------------------------------------------


def _down_for_two_ticks(k2b_clock, schedule_id: str, **spec) -> WorkflowSchedule:
    """Ticks every 5 minutes; the fleet is away for 12: ticks 5 and 10 are missed."""
    schedule = schedule_workflow(
        schedule_id, "sched.echo", Schedule(every=dt.timedelta(minutes=5), **spec)
    )
    k2b_clock.advance(minutes=12)
    return schedule


def test_catch_up_skip_starts_none_of_the_missed_ticks(k2b_clock):
    schedule = _down_for_two_ticks(k2b_clock, "cu-skip", catch_up="skip")
    run_until_idle(timeout=QUICK)

    assert runs("cu-skip") == []
    assert skips("cu-skip") == [("catch_up", 2)]
    assert row("cu-skip").next_tick == schedule.anchor + dt.timedelta(minutes=15)
    k2b_clock.advance(minutes=3)
    run_until_idle(timeout=QUICK)
    assert ticks("cu-skip") == [schedule.anchor + dt.timedelta(minutes=15)]


def test_catch_up_latest_starts_one_run_for_the_latest_missed_tick(k2b_clock):
    schedule = _down_for_two_ticks(k2b_clock, "cu-latest", catch_up="latest")
    run_until_idle(timeout=QUICK)

    assert ticks("cu-latest") == [schedule.anchor + dt.timedelta(minutes=10)]
    assert skips("cu-latest") == [("catch_up", 1)]


def test_a_late_pass_fires_the_current_tick_and_counts_the_earlier_one_as_missed(k2b_clock):
    schedule = schedule_workflow(
        "late-pass", "sched.echo", Schedule(every=dt.timedelta(minutes=1), catch_up="skip")
    )
    k2b_clock.advance(minutes=2, seconds=30)
    run_until_idle(timeout=QUICK)

    assert ticks("late-pass") == [schedule.anchor + dt.timedelta(minutes=2)]
    assert skips("late-pass") == [("catch_up", 1)]


@pytest.mark.parametrize("spec", [{"every": dt.timedelta(seconds=1)}, {"cron": "* * * * * *"}])
def test_a_day_of_missed_one_second_ticks_is_one_cheap_pass(k2b_clock, spec):
    cron = spec.pop("cron", None)
    schedule_workflow("a-day", "sched.echo", Schedule(cron, catch_up="latest", **spec))
    k2b_clock.advance(days=1)
    started = time.monotonic()
    run_until_idle(timeout=QUICK)  # a pass per missed tick would never end within it
    took = dt.timedelta(seconds=time.monotonic() - started)

    # One run for the latest tick (and one per tick that fell due while it ran): its
    # tick fell due within seconds of the pass, however long a loaded machine made it.
    first = runs("a-day")[0]
    assert first.created_at - first.scheduled_for < took + dt.timedelta(seconds=5)
    (reason, count), *_ = skips("a-day")
    assert reason == "catch_up"
    if cron is None:
        assert abs(count - 86_399) <= 2
    else:
        assert count >= 9_999  # cron ticks are counted one by one up to 10,000


def test_catch_up_all_starts_every_missed_tick_in_order(k2b_clock):
    schedule = _down_for_two_ticks(k2b_clock, "cu-all", catch_up="all", overlap="allow")
    run_until_idle(timeout=QUICK)

    assert ticks("cu-all") == [schedule.anchor + dt.timedelta(minutes=m) for m in (5, 10)]
    assert skips("cu-all") == []


def test_catch_up_all_starts_at_most_the_setting_per_pass_and_the_rest_next(k2b_clock, settings):
    settings.K2B_WORKFLOWS = {**settings.K2B_WORKFLOWS, "SCHEDULE_MAX_CATCH_UP": 3}
    schedule = schedule_workflow(
        "cu-cap",
        "sched.echo",
        Schedule(every=dt.timedelta(minutes=1), catch_up="all", overlap="allow"),
    )
    k2b_clock.advance(minutes=7, seconds=30)
    passes_started = []
    versions = {"sched.echo": {1}}
    while (result := schedule_passes.run_pass("default", versions)).started:
        passes_started.append(result.started)

    assert passes_started == [3, 3, 1]
    assert ticks("cu-cap") == [schedule.anchor + dt.timedelta(minutes=m) for m in range(1, 8)]


def test_catch_up_all_under_overlap_skip_starts_the_first_missed_tick_only(k2b_clock):
    """Overlap applies to caught-up ticks too: the first one's run has not ended yet."""
    schedule = _down_for_two_ticks(k2b_clock, "cu-all-skip", catch_up="all")
    run_until_idle(timeout=QUICK)

    assert ticks("cu-all-skip") == [schedule.anchor + dt.timedelta(minutes=5)]
    assert skips("cu-all-skip") == [("overlap", 1)]


# -- pause and resume --------------------------------------------------------


@pytest.mark.parametrize(
    ("catch_up", "expected_minutes"), [("skip", []), ("latest", [10]), ("all", [5, 10])]
)
def test_ticks_that_fall_while_paused_follow_catch_up_on_resume(
    k2b_clock, catch_up, expected_minutes
):
    schedule = schedule_workflow(
        "paused",
        "sched.echo",
        Schedule(every=dt.timedelta(minutes=5), catch_up=catch_up, overlap="allow"),
    )
    paused = row("paused")
    paused.paused = True
    paused.save()
    k2b_clock.advance(minutes=10, seconds=30)
    run_until_idle(timeout=QUICK)
    assert runs("paused") == []

    # Resumed 30 s after tick 10: missed, not because of its age but because it fell
    # while paused.
    resumed = row("paused")
    resumed.paused = False
    resumed.save()
    run_until_idle(timeout=QUICK)

    assert ticks("paused") == [schedule.anchor + dt.timedelta(minutes=m) for m in expected_minutes]
    k2b_clock.advance(minutes=5)
    run_until_idle(timeout=QUICK)
    assert ticks("paused")[-1] == schedule.anchor + dt.timedelta(minutes=15)


def test_an_edit_from_an_old_form_does_not_rewind_the_next_tick(k2b_clock):
    schedule_workflow("edited", "sched.echo", Schedule(every=dt.timedelta(minutes=1)))
    stale = row("edited")
    k2b_clock.advance(minutes=1)
    run_until_idle(timeout=QUICK)

    stale.input = {"changed": True}
    stale.save()
    run_until_idle(timeout=QUICK)

    assert len(runs("edited")) == 1
    assert row("edited").next_tick == runs("edited")[0].scheduled_for + dt.timedelta(minutes=1)


# -- overlap ----------------------------------------------------------------


def test_overlap_skip_starts_nothing_while_the_previous_run_is_unfinished(k2b_clock):
    schedule = schedule_workflow("ov-skip", "sched.waits", Schedule(every=dt.timedelta(minutes=1)))
    first = schedule.anchor + dt.timedelta(minutes=1)
    for _ in range(3):
        k2b_clock.advance(minutes=1)
        run_until_idle(timeout=QUICK)
    assert ticks("ov-skip") == [first]
    assert [s.reason for s in WorkflowScheduleSkip.objects.all()] == ["overlap", "overlap"]

    release(iso(first))
    run_until_idle(timeout=QUICK)
    k2b_clock.advance(minutes=1)
    run_until_idle(timeout=QUICK)

    assert ticks("ov-skip") == [first, schedule.anchor + dt.timedelta(minutes=4)]


def test_overlap_buffer_one_starts_one_tick_when_the_previous_run_ends(k2b_clock):
    schedule = schedule_workflow(
        "ov-buffer", "sched.waits", Schedule(every=dt.timedelta(minutes=1), overlap="buffer_one")
    )
    tick = [schedule.anchor + dt.timedelta(minutes=m) for m in range(5)]
    for _ in range(3):
        k2b_clock.advance(minutes=1)
        run_until_idle(timeout=QUICK)
    assert ticks("ov-buffer") == [tick[1]]
    assert row("ov-buffer").buffered_tick == tick[2]
    assert skips("ov-buffer") == [("buffer_full", 1)]

    release(iso(tick[1]))
    run_until_idle(timeout=QUICK)

    assert ticks("ov-buffer") == [tick[1], tick[2]]
    assert row("ov-buffer").buffered_tick is None


def test_overlap_allow_starts_every_tick(k2b_clock):
    schedule_workflow(
        "ov-allow", "sched.waits", Schedule(every=dt.timedelta(minutes=1), overlap="allow")
    )
    for _ in range(3):
        k2b_clock.advance(minutes=1)
        run_until_idle(timeout=QUICK)
    assert len(runs("ov-allow")) == 3


# -- daylight-saving time ----------------------------------------------------


def _next_transition(zone: str, forward: bool) -> dt.date:
    """The next day (after today) on which ``zone``'s clocks go forward (or back)."""
    tz = ZoneInfo(zone)
    day = dt.datetime.now(UTC).date() + dt.timedelta(days=1)
    for _ in range(800):
        noon = dt.datetime.combine(day, dt.time(12), tz)
        before = dt.datetime.combine(day - dt.timedelta(days=1), dt.time(12), tz)
        change = noon.utcoffset() - before.utcoffset()
        if change and (change > dt.timedelta(0)) == forward:
            return day
        day += dt.timedelta(days=1)
    raise AssertionError(f"no DST transition in {zone}")


def _walk_through_the_night(k2b_clock, zone: str, day: dt.date, cron: str) -> list[dt.datetime]:
    """Create the schedule at 00:00 local on ``day``, then walk to 06:00 in 10-minute steps."""
    tz = ZoneInfo(zone)
    k2b_clock.advance_to(dt.datetime.combine(day, dt.time(0), tz))
    schedule_workflow("dst", "sched.echo", Schedule(cron, timezone=zone, catch_up="skip"))
    end = dt.datetime.combine(day, dt.time(6), tz)
    while k2b_clock.now() < end:
        k2b_clock.advance(minutes=10)
        run_until_idle(timeout=QUICK)
    return ticks("dst")


@pytest.mark.parametrize(
    ("zone", "cron", "fires_at"),
    [
        # 02:30 does not exist: fired once, at the first instant after the gap (03:00).
        ("Europe/Berlin", "30 2 * * *", dt.time(3, 0)),
        ("America/New_York", "30 2 * * *", dt.time(3, 0)),
    ],
)
def test_a_local_time_that_does_not_exist_fires_once_at_the_next_valid_instant(
    k2b_clock, zone, cron, fires_at
):
    day = _next_transition(zone, forward=True)
    fired = _walk_through_the_night(k2b_clock, zone, day, cron)

    assert fired == [dt.datetime.combine(day, fires_at, ZoneInfo(zone)).astimezone(UTC)]
    assert skips("dst") == []


@pytest.mark.parametrize(
    ("zone", "cron", "repeated"),
    [
        ("Europe/Berlin", "30 2 * * *", dt.time(2, 30)),
        ("America/New_York", "30 1 * * *", dt.time(1, 30)),
    ],
)
def test_a_local_time_that_occurs_twice_fires_once(k2b_clock, zone, cron, repeated):
    day = _next_transition(zone, forward=False)
    fired = _walk_through_the_night(k2b_clock, zone, day, cron)

    first = dt.datetime.combine(day, repeated, ZoneInfo(zone))
    assert fired == [first.astimezone(UTC)]
    assert first.utcoffset() != first.replace(fold=1).utcoffset()  # it did occur twice


def test_a_half_hourly_cron_through_both_transitions_in_berlin(k2b_clock):
    tz = ZoneInfo("Europe/Berlin")
    day = _next_transition("Europe/Berlin", forward=True)
    fired = _walk_through_the_night(k2b_clock, "Europe/Berlin", day, "*/30 * * * *")
    local = [t.astimezone(tz).strftime("%H:%M%z") for t in fired]
    # 02:00 and 02:30 do not exist: they merge into 03:00; nothing fires twice.
    assert local[:6] == [
        "00:30+0100",
        "01:00+0100",
        "01:30+0100",
        "03:00+0200",
        "03:30+0200",
        "04:00+0200",
    ]
    assert len(fired) == len(set(fired))


# -- run now, decorator schedules ----------------------------------------------


def test_run_now_starts_a_run_outside_the_ticks(k2b_clock):
    schedule = schedule_workflow("now", "sched.echo", Schedule("0 3 * * *", input={"a": 1}))
    run = run_schedule_now(schedule)

    assert (run.schedule_id, run.input["a"]) == ("now", 1)
    assert run.idempotency_key.startswith("schedule:now:now:")
    assert row("now").next_tick == schedule.next_tick


@pytest.fixture
def decorated():
    """Register a workflow with ``schedule=``; the suite's registry is put back after."""
    saved = {name: dict(versions) for name, versions in workflows._registry.items()}

    def define(schedule: Schedule | None) -> None:
        workflow("sched.decorated", app_id="sched", schedule=schedule)(lambda run, input: {})

    yield define
    workflows._registry.clear()
    workflows._registry.update(saved)


def test_migrate_writes_a_decorator_schedule_and_disables_it_once_removed(decorated, k2b_clock):
    decorated(Schedule(every=dt.timedelta(minutes=1), input={"kind": "daily"}))
    call_command("migrate", verbosity=0)

    written = row("sched.decorated")
    assert (written.source, written.enabled, written.input) == (
        "decorator",
        True,
        {"kind": "daily"},
    )
    k2b_clock.advance(minutes=1)
    run_until_idle(timeout=QUICK)
    assert len(runs("sched.decorated")) == 1

    decorated(None)
    call_command("migrate", verbosity=0)
    removed = row("sched.decorated")
    assert (removed.enabled, removed.disabled_reason) == (False, REMOVED_FROM_DECORATOR)
    k2b_clock.advance(minutes=5)
    run_until_idle(timeout=QUICK)
    assert len(runs("sched.decorated")) == 1


def test_a_flush_writes_the_decorator_schedules_again_and_they_fire(decorated, k2b_clock):
    """What a transactional test case does after each test: the next test finds the
    decorator's schedule as ``migrate`` wrote it, and it fires (#38)."""
    decorated(Schedule(every=dt.timedelta(minutes=1), input={"kind": "daily"}))
    call_command("migrate", verbosity=0)
    call_command("flush", verbosity=0, interactive=False)

    written = row("sched.decorated")
    assert (written.source, written.enabled, written.seal_problem()) == ("decorator", True, None)
    k2b_clock.advance(minutes=1)
    run_until_idle(timeout=QUICK)
    assert len(runs("sched.decorated")) == 1


def test_a_decorator_schedule_cannot_be_taken_over_by_schedule_workflow(decorated):
    decorated(Schedule("0 3 * * *"))
    sync_decorator_schedules()
    with pytest.raises(InvalidSchedule, match="@workflow") as caught:
        schedule_workflow("sched.decorated", "sched.echo", Schedule("0 4 * * *"))
    assert caught.value.field == "schedule_id"


# -- bad input ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "field", "message"),
    [
        ({"cron": "61 * * * *"}, "cron", "Bad minute"),
        ({"cron": "* * *"}, "cron", "3 fields"),
        ({"cron": "0 3 * * *", "timezone": "Europe/Atlantis"}, "timezone", "not a known time zone"),
        ({"cron": "0 3 * * *", "every": dt.timedelta(hours=1)}, "cron", "got both"),
        ({}, "cron", "got neither"),
        ({"every": dt.timedelta(milliseconds=999)}, "every", "under one second"),
        ({"every": 60}, "every", "must be a timedelta"),
        ({"cron": "0 3 * * *", "input": {"when": dt.date(2027, 1, 1)}}, "input", "JSON"),
        ({"cron": "0 3 * * *", "input": [1, 2]}, "input", "JSON object"),
        ({"cron": "0 3 * * *", "input": {"scheduled_for": "x"}}, "input", "scheduled_for"),
        ({"cron": "0 3 * * *", "catch_up": "some"}, "catch_up", "'skip', 'latest', 'all'"),
        ({"cron": "0 3 * * *", "overlap": "queue"}, "overlap", "buffer_one"),
        ({"cron": "0 3 * * *", "jitter": -dt.timedelta(seconds=1)}, "jitter", "zero or more"),
    ],
)
def test_a_bad_schedule_is_a_clear_error_naming_the_field(spec, field, message):
    cron = spec.pop("cron", None)
    with pytest.raises(InvalidSchedule, match=message) as caught:
        Schedule(cron, **spec)
    assert caught.value.field == field


def test_a_schedule_for_an_unknown_workflow_or_version_is_refused_before_writing():
    with pytest.raises(UnknownWorkflow, match=r"sched\.nope"):
        schedule_workflow("x", "sched.nope", Schedule("0 3 * * *"))
    with pytest.raises(UnknownWorkflow, match="no version 7"):
        schedule_workflow("x", "sched.echo", Schedule("0 3 * * *"), version=7)
    assert not WorkflowSchedule.objects.exists()


def test_a_decorator_schedule_must_be_a_schedule():
    with pytest.raises(InvalidSchedule.__mro__[1], match="must be a Schedule"):
        workflow("sched.bad_schedule", schedule="0 3 * * *")


def test_a_row_written_around_the_validation_is_disabled_not_fired(k2b_clock):
    schedule_workflow("tampered", "sched.echo", Schedule(every=dt.timedelta(minutes=1)))
    WorkflowSchedule.objects.filter(schedule_id="tampered").update(cron="99 * * * *", every=None)
    resealed(row("tampered"))  # by a key holder (a dump of an older release, restored)
    k2b_clock.advance(minutes=1)
    run_until_idle(timeout=QUICK)

    tampered = row("tampered")
    assert runs("tampered") == []
    assert not tampered.enabled and "Bad minute" in tampered.disabled_reason
