"""``manage.py workflowqueues``: the queues with their counts, and pausing and resuming one (#49).

    manage.py workflowqueues [list]                      each queue, its counts, paused or not
    manage.py workflowqueues pause NAME --reason TEXT    no worker claims its runs until resumed
    manage.py workflowqueues resume NAME                 workers claim its runs again, at once

``--actor USERNAME`` names the Django user who pauses or resumes: that user
needs ``k2b_workflows.pause_queue``, and the change enters the admin's history.
Without it the pause records the operating-system user running the command.
"""

from __future__ import annotations

import getpass
import json
from typing import Any

from django.contrib.auth import get_user_model
from django.core.exceptions import PermissionDenied
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from k2b_workflows import control, queues
from k2b_workflows.exceptions import InvalidInput
from k2b_workflows.management import arguments
from k2b_workflows.management.commands.workflowruns import format_table


def _when(value: Any) -> str:
    return "-" if value is None else timezone.localtime(value).strftime("%Y-%m-%d %H:%M:%S%z")


def _age(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.0f}s"


def _actor(username: str | None) -> Any:
    """The Django user named ``--actor``, or the OS user's name as a label."""
    if username is None:
        try:
            return f"{getpass.getuser()} (command line)"
        except (KeyError, OSError):
            return "command line"
    User = get_user_model()
    try:
        return User._default_manager.get_by_natural_key(username)
    except User.DoesNotExist:
        raise CommandError(f"--actor: no user {username!r}") from None


class Command(BaseCommand):
    help = "List the queues with their counts; pause or resume one for every worker."

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="action")
        listing = sub.add_parser("list", help="each queue, its runs per status, paused or not")
        listing.add_argument("--json", action="store_true", help="print one JSON object")
        pause = sub.add_parser("pause", help="no worker claims the queue's runs until resumed")
        pause.add_argument("name", type=arguments.text(100), help="the queue")
        pause.add_argument("--reason", required=True, help="why: shown with the pause")
        pause.add_argument("--actor", metavar="USERNAME", help="the Django user pausing it")
        resume = sub.add_parser("resume", help="workers claim the queue's runs again, at once")
        resume.add_argument("name", type=arguments.text(100), help="the queue")
        resume.add_argument("--actor", metavar="USERNAME", help="the Django user resuming it")

    def handle(self, *args: Any, **options: Any) -> None:
        action = options.get("action") or "list"
        try:
            if action == "pause":
                self._pause(options["name"], options["reason"], options["actor"])
            elif action == "resume":
                self._resume(options["name"], options["actor"])
            else:
                self._list(json_output=options.get("json", False))
        except (InvalidInput, PermissionDenied) as exc:
            raise CommandError(str(exc)) from exc

    def _pause(self, name: str, reason: str, actor: str | None) -> None:
        if control.pause_queue(name, reason=reason, actor=_actor(actor)):
            self.stdout.write(f"queue {arguments.printable(name)} paused")
            return
        pause = control.paused_queues()[name]
        self.stdout.write(
            f"queue {arguments.printable(name)} was paused already, by"
            f" {arguments.printable(pause.paused_by) or '-'} at {_when(pause.paused_at)}:"
            f" {arguments.printable(pause.reason)}"
        )

    def _resume(self, name: str, actor: str | None) -> None:
        if control.resume_queue(name, actor=_actor(actor)):
            self.stdout.write(f"queue {arguments.printable(name)} resumed")
        else:
            self.stdout.write(f"queue {arguments.printable(name)} was not paused: nothing to do")

    def _list(self, *, json_output: bool) -> None:
        views = queues.read()
        if json_output:
            self.stdout.write(json.dumps([self._json(v) for v in views], indent=2))
            return
        if not views:
            self.stdout.write("no queues")
            return
        heads = ["QUEUE", "STATE", *(s.upper() for s in queues.STATUSES), "OLDEST READY"]
        table = [
            [
                arguments.printable(v.name),
                "active" if v.pause is None else "PAUSED",
                *(count for _, count in v.shown_counts()),
                _age(v.oldest_ready_s),
            ]
            for v in views
        ]
        self.stdout.write(
            format_table(
                [*heads, "DONE/MIN"],
                [[*row, f"{v.per_minute:.1f}"] for row, v in zip(table, views, strict=True)],
            )
        )
        for v in views:
            if v.pause is not None:
                self.stdout.write(
                    f"{arguments.printable(v.name)}: PAUSED by"
                    f" {arguments.printable(v.pause.paused_by) or '-'}"
                    f" at {_when(v.pause.paused_at)}: {arguments.printable(v.pause.reason)}"
                )

    @staticmethod
    def _json(view: queues.QueueView) -> dict[str, Any]:
        pause = view.pause
        return {
            "queue": view.name,
            "counts": view.counts,
            "count_cap": queues.COUNT_CAP,
            "oldest_ready_s": view.oldest_ready_s,
            "finished_per_minute": round(view.per_minute, 2),
            "paused": None
            if pause is None
            else {
                "reason": pause.reason,
                "paused_by": pause.paused_by,
                "paused_at": pause.paused_at.isoformat(),
            },
        }
