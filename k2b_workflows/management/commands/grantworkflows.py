"""``manage.py grantworkflows ROLE``: the privileges of the runtime role, printed or applied."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import DatabaseError

from k2b_workflows import roles, settings


class Command(BaseCommand):
    help = (
        "Print the GRANT/REVOKE statements that let ROLE (the role web and workers connect "
        "as) read and add evidence but never change or remove it; --apply runs them. "
        "Run as the owner of the tables."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("role", help="the runtime role (must exist; create it yourself)")
        parser.add_argument("--apply", action="store_true", help="run the statements")
        parser.add_argument(
            "--database",
            default=None,
            help="alias connected as the owner (default: OWNER_DATABASE, else DATABASE)",
        )

    def handle(
        self, *args: Any, role: str, apply: bool, database: str | None, **options: Any
    ) -> None:
        using = database or settings.owner_database()
        try:
            if apply:
                statements = roles.apply_grants(role, using)
            else:
                statements = roles.runtime_grants(role, using)
        except DatabaseError as exc:
            verb = "apply" if apply else "prepare"
            raise CommandError(f"could not {verb} grants: {exc}") from exc
        for sql in statements:
            self.stdout.write(sql + ";")
        if apply:
            self.stdout.write(f"-- applied to {role} on {using!r}")
