"""Schedules' rows: the spec and the state every worker's passes share, and skipped ticks.

The failure these rows guard against: two writers of one schedule undoing each
other. The passes (``kernel/schedule_passes.py``) move the next tick on in raw SQL
under a row lock; an operator's edit, loaded minutes before, must not write an
old next tick back and fire a tick again. So ``WorkflowSchedule.save`` writes
the passes' fields only when the spec changed (the ticks then start afresh
after now) or the schedule was resumed, and reads now from the database.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Collection, Mapping
from typing import Any, Protocol

from django.core.exceptions import ImproperlyConfigured
from django.db import connections, models, transaction
from django.utils import timezone

from .. import naming, schedules, settings
from ..exceptions import InvalidSchedule
from ..schedules import Schedule

#: ``timezone.now`` under a name a model's ``timezone`` field cannot shadow.
_now = timezone.now


class Sealer(Protocol):
    """What seals a schedule row: ``kernel/schedule_seals.py`` (the HMAC under the evidence key)."""

    SEALED_FIELDS: tuple[str, ...]

    def seal(self, values: Mapping[str, Any]) -> str: ...

    def problem(self, values: Mapping[str, Any], sealed: str) -> str | None: ...


class _Unset:
    """Until ``AppConfig.ready()``: a save then would write a row no pass fires."""

    SEALED_FIELDS: tuple[str, ...] = ()

    def seal(self, values: Mapping[str, Any]) -> str:
        raise ImproperlyConfigured("k2b_workflows is not ready: schedules cannot be sealed yet")

    def problem(self, values: Mapping[str, Any], sealed: str) -> str | None:
        return self.seal(values)


#: The kernel's schedule sealer, handed down by ``AppConfig.ready()``: the model
#: layer holds no key and may not import the kernel that does.
sealer: Sealer = _Unset()


#: The database's time (k2b_now(), which a test's clock may move).
NOW_SQL = "SELECT k2b_now()"


class WorkflowSchedule(models.Model):
    """A workflow that starts by itself: on a cron expression or every fixed interval.

    The spec (``cron`` or ``every``, ``timezone``, ``input``, ``catch_up``,
    ``overlap``, ``jitter``) is what ``Schedule`` validates; the rest is the
    state the schedule passes of every worker share (``kernel/schedule_passes.py``):
    the next tick and when it fires, the last one fired, a tick buffered
    behind a run still going. Save the row with ``paused`` set or cleared to
    pause or resume it; a save that changes the spec starts the ticks afresh
    after that moment (nothing before counts as missed).
    """

    class Source(models.TextChoices):
        DECORATOR = "decorator"  # @workflow(schedule=...), written by migrate
        CODE = "code"  # schedule_workflow(...)
        ADMIN = "admin"

    class CatchUp(models.TextChoices):
        SKIP = "skip"
        LATEST = "latest"
        ALL = "all"

    class Overlap(models.TextChoices):
        SKIP = "skip"
        ALLOW = "allow"
        BUFFER_ONE = "buffer_one", "buffer one"

    schedule_id = models.CharField(max_length=200, unique=True)
    workflow_name = models.CharField(max_length=200)
    #: None: the newest version registered in the worker that fires the tick.
    workflow_version = models.PositiveIntegerField(null=True, blank=True)
    cron = models.CharField(max_length=200, blank=True, default="")
    every = models.DurationField(null=True, blank=True)
    timezone = models.CharField(max_length=64, default="UTC")
    input = models.JSONField(default=dict, blank=True)
    catch_up = models.CharField(max_length=10, choices=CatchUp.choices, default=CatchUp.LATEST)
    overlap = models.CharField(max_length=12, choices=Overlap.choices, default=Overlap.SKIP)
    jitter = models.DurationField(null=True, blank=True)
    paused = models.BooleanField(default=False)
    source = models.CharField(max_length=10, choices=Source.choices, default=Source.CODE)
    #: False for a decorator's schedule whose decorator no longer declares it:
    #: kept (with its history) but never fired, until the decorator is back.
    enabled = models.BooleanField(default=True)
    disabled_reason = models.CharField(max_length=300, blank=True, default="")

    # The state the passes share. Written by the passes and by the spec's saves.
    #: ``every`` ticks are ``anchor + k * every``; set when the spec was last set.
    anchor = models.DateTimeField(default=_now)
    next_tick = models.DateTimeField(null=True, blank=True)
    #: ``next_tick`` plus its jitter: a pass fires the tick once this has passed.
    next_fire_at = models.DateTimeField(null=True, blank=True)
    last_tick = models.DateTimeField(null=True, blank=True)
    last_run_id = models.UUIDField(null=True, blank=True)
    #: ``overlap="buffer_one"``: the tick that starts when the unfinished run ends.
    buffered_tick = models.DateTimeField(null=True, blank=True)
    #: The last resume: ticks up to it were missed, whatever their age.
    resumed_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(default=_now)
    updated_at = models.DateTimeField(default=_now)
    #: HMAC under the evidence key over ``kernel/schedule_seals.SEALED_FIELDS``, written by
    #: every save and every pass: a row the runtime role wrote has none that matches.
    seal = models.CharField(max_length=100, blank=True, default="", editable=False)

    #: Fields a pass writes; an edit of the spec leaves them to the pass.
    STATE_FIELDS = (
        "anchor",
        "next_tick",
        "next_fire_at",
        "last_tick",
        "last_run_id",
        "buffered_tick",
        "resumed_at",
    )
    SPEC_FIELDS = ("cron", "every", "timezone", "jitter")
    #: Set by a caller whose save writes the whole spec from its own source (code,
    #: a decorator, the operator's form): it may seal a row that failed its seal.
    reviewed: bool = False

    class Meta:
        db_table = "k2b_schedule"
        ordering = ["schedule_id"]
        permissions = [
            ("pause_workflowschedule", "Can pause and resume a workflow schedule"),
            ("run_workflowschedule", "Can run a workflow schedule now"),
        ]
        indexes = [
            # What a pass and its "anything due?" probe read: the due rows, oldest
            # first. Paused and disabled rows have no entry.
            models.Index(
                fields=["next_fire_at"],
                condition=models.Q(enabled=True, paused=False),
                name="k2b_schedule_due",
            ),
            models.Index(
                fields=["buffered_tick"],
                condition=models.Q(enabled=True, paused=False, buffered_tick__isnull=False),
                name="k2b_schedule_buffered",
            ),
        ]

    def __str__(self) -> str:
        return self.schedule_id

    def save(self, *args: Any, **kwargs: Any) -> None:
        """Validate the spec, keep the passes' state consistent, and seal the row.

        A new row or a changed spec: the ticks start after now (the database's
        clock, ``k2b_now()``). A resume: the ticks missed while paused are left
        to ``catch_up``. Otherwise the passes' fields are not written, so an
        edit from a form loaded a while ago cannot rewind the next tick.

        The stored row is read under a lock first: the seal covers it as it
        will be after this write (the fields not written are the stored ones).
        A stored row whose seal does not match was written by someone without
        the evidence key: only a save that writes its whole spec (``reviewed``
        set: ``schedule_workflow``, ``migrate``, the admin's change form) may
        seal it again, and its ticks start afresh; a pause or resume raises
        ``InvalidSchedule`` instead of sealing what nobody checked.
        """
        spec = self.spec()
        self.cron, self.input = spec.cron or "", spec.input
        loaded: dict[str, Any] = getattr(self, "_loaded", None) or {}
        adding = self._state.adding or not loaded
        using = kwargs.get("using") or self._state.db or settings.database()
        with transaction.atomic(using=using):
            stored = None if adding else self._stored(using)
            tampered = stored is not None and bool(sealer.problem(stored, stored["seal"]))
            if tampered and not getattr(self, "reviewed", False):
                raise InvalidSchedule(
                    f"schedule {self.schedule_id!r} was changed outside migrate,"
                    " schedule_workflow() and the admin (its seal does not match): check"
                    " every field on its admin page and save it there, or delete it",
                    field="seal",
                )
            with connections[using].cursor() as cursor:
                cursor.execute(NOW_SQL)
                now = cursor.fetchone()[0]
            self.updated_at = now
            changed = (
                adding
                or tampered
                or any(
                    name in loaded and loaded[name] != getattr(self, name)
                    for name in self.SPEC_FIELDS
                )
            )
            resumed = not adding and (
                (loaded.get("paused") and not self.paused)
                or (loaded.get("enabled") is False and self.enabled)
            )
            if adding:
                self.created_at = now
            if changed:
                self.anchor = now
                self.next_tick = spec.next_tick(now, now)
                self.next_fire_at = self.fire_at(self.next_tick)
            if tampered:
                # Nothing of the stored state is the key holder's: no buffered tick.
                self.buffered_tick = None
            if resumed:
                self.resumed_at = now
            written = {"updated_at", "seal"} | ({"resumed_at"} if resumed else set())
            if changed:
                written |= {"anchor", "next_tick", "next_fire_at"}
            if tampered:
                written |= set(self.STATE_FIELDS)
            if not adding and kwargs.get("update_fields") is not None:
                kwargs["update_fields"] = sorted(set(kwargs["update_fields"]) | written)
            elif not adding:
                keep = (
                    set()
                    if changed
                    else set(self.STATE_FIELDS) - ({"resumed_at"} if resumed else set())
                )
                kwargs["update_fields"] = [
                    f.name
                    for f in self._meta.concrete_fields
                    if not f.primary_key and f.name not in keep
                ]
            if stored is not None:
                for name in sealer.SEALED_FIELDS:
                    if name not in kwargs["update_fields"]:
                        setattr(self, name, stored[name])
            self.seal = sealer.seal(self.sealed_values())
            super().save(*args, **kwargs)
        self.reviewed = False
        self._loaded = {
            name: getattr(self, name) for name in (*self.SPEC_FIELDS, "paused", "enabled")
        }

    @property
    def display_name(self) -> str:
        """What the schedule starts, as a run of it is called: a task's path for a task (#51)."""
        return naming.display_name(self.workflow_name, naming.input_task_path(self.input))

    def _stored(self, using: str) -> dict[str, Any] | None:
        """The row as stored (the sealed fields and the seal), locked until the save commits."""
        return (
            type(self)
            .objects.using(using)
            .select_for_update()
            .filter(pk=self.pk)
            .values(*sealer.SEALED_FIELDS, "seal")
            .first()
        )

    def sealed_values(self) -> dict[str, Any]:
        """The fields the seal covers, as this object holds them."""
        return {name: getattr(self, name) for name in sealer.SEALED_FIELDS}

    def seal_problem(self) -> str | None:
        """Why this row (as loaded) was not written by the key holder, or None."""
        return sealer.problem(self.sealed_values(), self.seal)

    @classmethod
    def from_db(
        cls,
        db: str | None,
        field_names: Collection[str],
        values: Collection[Any],
        *args: Any,
        **kwargs: Any,
    ) -> WorkflowSchedule:
        # Django 6 passes ``fetch_mode`` (and warns about overrides that refuse it).
        instance = super().from_db(db, field_names, values, *args, **kwargs)
        instance._loaded = {
            name: getattr(instance, name)
            for name in (*cls.SPEC_FIELDS, "paused", "enabled")
            if name in field_names
        }
        return instance

    def spec(self) -> Schedule:
        """The row's spec as a validated ``Schedule`` (raises ``InvalidSchedule``)."""
        return Schedule.from_row(self)

    def fire_at(self, tick: dt.datetime) -> dt.datetime:
        """When a pass fires ``tick``: the tick plus its jitter."""
        return tick + schedules.jitter_for(self.schedule_id, tick, self.jitter)


class WorkflowScheduleSkip(models.Model):
    """Ticks of a schedule that started no run, and why: shown on its admin page.

    One row per stretch of skipped ticks of one reason (a day of downtime is
    one row, with its count), so recording them stays cheap.
    """

    class Reason(models.TextChoices):
        CATCH_UP = "catch_up", "missed (catch_up)"
        OVERLAP = "overlap", "previous run not ended (overlap)"
        BUFFER_FULL = "buffer_full", "a tick was already buffered (buffer_one)"

    schedule = models.ForeignKey(WorkflowSchedule, on_delete=models.CASCADE, related_name="skips")
    first_tick = models.DateTimeField()
    last_tick = models.DateTimeField()
    count = models.PositiveIntegerField(default=1)
    reason = models.CharField(max_length=20, choices=Reason.choices)
    recorded_at = models.DateTimeField(default=timezone.now)

    class Meta:
        db_table = "k2b_schedule_skip"
        ordering = ["-recorded_at", "-id"]

    def __str__(self) -> str:
        return f"{self.schedule_id}: {self.count} tick(s) skipped ({self.reason})"
