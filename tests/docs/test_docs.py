"""The documentation's code runs, and stays that way.

Every ```python block of docs/*.md is one of:

* included from a source file the suite runs (pymdownx.snippets): the examples
  in docs/examples/ (run by tests/docs/test_docs_examples.py), the demo shop (run
  below: ``manage.py demo`` and a dry run of each demo workflow) and test
  modules such as tests/docs/test_testing_recipes.py;
* configuration kept inline, listed in ``INLINE`` with the test that
  evaluates it here.

README.md cannot include files (GitHub shows it as is): its block must equal a
section of docs/examples (``MIRRORED``). A new inline block fails
``test_every_python_block_is_included_or_listed_as_configuration`` until it
is moved to docs/examples or listed, with a test. The ``manage.py`` lines of
the ```sh blocks are run as shown, unless ``NOT_RUN`` says why not, and every
``make`` target the docs name exists.
"""

from __future__ import annotations

import importlib
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import environ
import pytest
from django.conf import settings
from django.core.management import call_command
from django.db import connection
from django.test import override_settings

from k2b_workflows import dry_run, start_workflow_run, store
from k2b_workflows import settings as k2b_settings
from k2b_workflows.checks import check_database, check_settings
from k2b_workflows.models import LedgerEntry, WorkflowRun
from k2b_workflows.testing import assert_run_status, run_until_idle
from tests.support.doc_blocks import EXAMPLES, ROOT, Block, block, blocks, examples, section

from . import test_docs_examples

#: Where an included block may come from: files the suite runs (tests/<area>/test_*.py
#: are pytest modules themselves, e.g. the recipes of docs/testing.md).
INCLUDED_FROM = (
    "docs/examples/",
    "example_project/demo/workflows.py",
    "example_project/demo/models.py",
    "tests/docs/test_",
)

#: The witness's one-line setup on docs/security.md (W040 is silent with it).
ONE_LINE_WITNESS = (
    'LOGGING = {"version": 1, "handlers": {"console": {"class": "logging.StreamHandler"}},'
    ' "loggers": {"k2b_workflows.witness": {"handlers": ["console"], "level": "INFO"}}}'
)

#: (page, first line) of each inline block -> the test that evaluates it.
INLINE = {
    ("docs/getting-started.md", "INSTALLED_APPS = ["): (
        "test_the_quickstart_installed_apps_hold_what_the_checks_need"
    ),
    ("docs/getting-started.md", "DATABASES = {"): "test_the_quickstart_databases_is_postgresql",
    ("docs/operations.md", "K2B_WORKFLOWS = {"): (
        "test_the_settings_of_operations_md_are_the_defaults_and_pass_the_checks"
    ),
    ("docs/operations.md", "DATABASES = {"): "test_the_pgbouncer_settings_pass_the_checks",
    ("docs/high-availability.md", "DATABASES = {"): (
        "test_the_multi_host_settings_of_high_availability_md_are_the_tested_ones"
    ),
    ("docs/performance.md", "DATABASES = {"): (
        "test_the_prepared_statements_setting_of_performance_md_reaches_psycopg"
    ),
    ("docs/operators.md", 'K2B_WORKFLOWS = {"REDACT_HOOK": "myapp.redaction.hide_emails"}'): (
        "test_the_redaction_setting_is_known_and_passes_the_checks"
    ),
    ("docs/security.md", "# settings.py"): "test_the_two_role_settings_pass_the_checks",
    ("docs/tasks.md", "# settings.py"): "test_the_tasks_setting_of_tasks_md_makes_the_backend",
    ("docs/library-tasks.md", "# settings.py: Wagtail's tasks"): (
        "test_the_wagtail_settings_of_library_tasks_md_make_the_backend"
    ),
    ("docs/library-tasks.md", "# settings.py: one of Wagtail's tasks kept external"): (
        "test_the_wagtail_settings_of_library_tasks_md_make_the_backend"
    ),
    ("docs/tasks.md", "# settings.py: tasks you do not own"): (
        "test_the_tasks_you_do_not_own_of_tasks_md_make_the_backend"
    ),
    ("docs/security.md", "LOGGING = {"): "test_the_witness_logging_of_security_md_writes_records",
    ("docs/security.md", ONE_LINE_WITNESS): (
        "misuse.test_witness_check.test_the_one_line_setup_of_security_md_silences_the_warning"
    ),
    ("docs/getting-started.md", ONE_LINE_WITNESS): (
        "test_an_existing_project_with_its_own_databases_adds_the_app_as_getting_started_says"
    ),
    ("docs/testing.md", "# settings used by your test run"): (
        "test_the_test_settings_of_testing_md_are_the_suites"
    ),
    ("docs/testing.md", 'pytest_plugins = ["k2b_workflows.pytest_plugin"]'): (
        "test_the_plugin_line_of_testing_md_loads_the_fixtures_it_lists"
    ),
    # Code, not configuration: a Django test module, run as shown in a fresh project.
    ("docs/testing.md", "# orders/tests.py, run by manage.py test"): (
        "docs.test_fresh_project.test_djangos_testcase_and_transactiontestcase_pass_in_a_fresh_project"
    ),
    # Code, not configuration: two lines that need the page's context; run as shown
    # in tests/docs/test_docs_examples.py.
    (
        "docs/testing.md",
        'wake_workflow_runs_waiting_on(app_id="shop", kind="approval", key="order-1")',
    ): "docs.test_docs_examples.test_the_wake_of_testing_md_runs",
}

#: (page, first line) of a block that cannot include -> the section it must equal.
MIRRORED = {
    ("README.md", '@workflow("shop.checkout", app_id="shop", effect_budget={"charges": 1})'): (
        "docs/examples/getting_started.py:checkout"
    ),
}

#: ``manage.py`` lines of the ```sh blocks the suite does not run as shown, and why.
NOT_RUN = {
    "runworkflows [--app APP ...] [--queue NAME ...] [--processes N|auto] [--concurrency N] "
    "[--burst] "
    "[--no-listen] [--no-schedules] [--health-file PATH] [--metrics-port PORT] "
    "[--wait-for-db SECONDS] [--log-format text|json]": ("a synopsis"),
    "runworkflows --concurrency 8": (
        "runs until SIGTERM: tests/worker/test_worker_command.py starts and stops real workers"
    ),
    "migrate --database owner": (
        "needs a second role; tests/misuse/test_roles.py migrates as the owner"
    ),
    "grantworkflows k2b_app --apply": (
        "changes the server's roles; tests/misuse/test_roles.py applies it"
    ),
    'workflowrun start shop.checkout --input {"sku": "TEA-01", "amount": 2900} --json': (
        "its JSON's quotes do not survive the join and split of this test:"
        " tests/admin/test_workflowrun_command.py starts runs with JSON input"
    ),
    "workflowrun start shop.checkout --input - --json": (
        "reads stdin: tests/admin/test_workflowrun_command.py feeds stdin to resolve --output -"
    ),
    "workflowqueues pause mail --reason the mail provider is down": (
        "its reason's quotes do not survive the join and split of this test:"
        " tests/admin/test_queues.py pauses with a reason of several words"
    ),
    "verifyworkflows --witness /var/log/k2b/witness.log": (
        "reads a production log; tests/kernel/test_witness.py runs it on witness files of its own"
    ),
}


def python_block_ids(found: list[Block]) -> list[str]:
    return [b.where for b in found]


# -- the rule: included, listed or mirrored --------------------------------------------------


@pytest.mark.parametrize("code", blocks("python"), ids=python_block_ids(blocks("python")))
def test_every_python_block_is_included_or_listed_as_configuration(code: Block) -> None:
    key = (code.page, code.first_line)
    if code.includes:
        for include in code.includes:
            assert include.startswith(INCLUDED_FROM), (
                f"{code.where} includes {include}: include only files the suite runs"
            )
            section(include)  # the section exists
    elif key in MIRRORED:
        assert code.code == section(MIRRORED[key]), (
            f"{code.where} differs from {MIRRORED[key]}: copy the section into the README"
        )
    else:
        assert key in INLINE, (
            f"{code.where} is inline Python: move it to docs/examples/<topic>.py, include it "
            "with --8<-- and run it in tests/docs/test_docs_examples.py, or, if it is "
            "configuration, "
            "list it in INLINE with the test that evaluates it"
        )


def test_the_listed_blocks_exist_and_have_their_tests() -> None:
    shown = {(b.page, b.first_line) for b in blocks("python") if not b.includes}
    for key, test in INLINE.items():
        assert key in shown, f"INLINE lists {key}, which no page shows any more"
        module, _, name = test.rpartition(".")
        where = importlib.import_module(f"tests.{module}") if module else sys.modules[__name__]
        assert callable(getattr(where, name))
    for key in MIRRORED:
        assert key in shown, f"MIRRORED lists {key}, which no page shows any more"


def example_modules() -> set[str]:
    scaffolding = {"__init__", "apps", "models", "providers"}
    return {p.stem for p in EXAMPLES.glob("*.py")} - scaffolding


def test_every_example_module_is_run_by_a_test() -> None:
    assert set(test_docs_examples.RUN_BY) == example_modules()
    for module, tests in test_docs_examples.RUN_BY.items():
        for name in tests:
            assert callable(getattr(test_docs_examples, name, None)), (module, name)
            source = Path(test_docs_examples.__file__).read_text()
            assert re.search(rf"def {name}\(", source), name


def test_every_example_section_is_shown_on_a_page() -> None:
    shown = {inc for b in blocks("python") for inc in b.includes} | set(MIRRORED.values())
    for path in sorted(EXAMPLES.glob("*.py")):
        for name in re.findall(r"^\s*# --8<-- \[start:(\w+)\]$", path.read_text(), re.M):
            include = f"{path.relative_to(ROOT)}:{name}"
            assert include in shown, f"{include} is on no page"


def test_every_action_of_the_examples_is_named_and_plans_if_not_pure() -> None:
    from k2b_workflows import Action, Effect
    from k2b_workflows.checks import check_actions

    for name in sorted(example_modules() - {"public_api"}):
        with examples(name) as (module,):
            actions = [
                v
                for v in vars(module).values()
                if isinstance(v, type) and issubclass(v, Action) and v.__module__ == module.__name__
            ]
            for action in actions:
                assert action.__dict__.get("name"), action
                assert action.effect == Effect.PURE or action.defines("plan"), action
            assert not [m for m in check_actions() if m.obj in actions]


# -- configuration blocks ---------------------------------------------------------------------


def evaluate(page: str, first_line: str, **names: Any) -> dict[str, Any]:
    code = block(page, first_line)
    namespace: dict[str, Any] = dict(names)
    exec(compile(code.code, code.where, "exec"), namespace)
    return namespace


def settings_errors(**overrides: Any) -> list:
    with override_settings(**overrides):
        return check_settings() + check_database()


def test_the_quickstart_installed_apps_hold_what_the_checks_need() -> None:
    apps = evaluate("docs/getting-started.md", "INSTALLED_APPS = [")["INSTALLED_APPS"]
    assert apps[0] is Ellipsis, "the page adds to a project's own apps"
    named = apps[1:]
    # check_pgtrigger (E003) needs pgtrigger; the app itself is k2b_workflows.
    assert set(named) == {"pgtrigger", "k2b_workflows"}
    assert all(app in settings.INSTALLED_APPS for app in named)


def test_the_quickstart_databases_is_postgresql() -> None:
    databases = evaluate("docs/getting-started.md", "DATABASES = {")["DATABASES"]
    assert databases["default"]["ENGINE"] == "django.db.backends.postgresql"
    assert all(databases["default"][key] for key in ("NAME", "USER", "HOST", "PORT"))


def test_the_settings_of_operations_md_are_the_defaults_and_pass_the_checks() -> None:
    shown = evaluate("docs/operations.md", "K2B_WORKFLOWS = {")["K2B_WORKFLOWS"]
    assert set(shown) <= store.known_settings()
    assert shown == {key: k2b_settings.default(key) for key in shown}
    assert settings_errors(K2B_WORKFLOWS=shown) == []


def test_the_reference_lists_every_setting_as_declared() -> None:
    """docs/reference.md's settings table is ``k2b_workflows.settings`` rendered: a key, a
    default or a meaning changed in one place and not the other fails here."""
    page = (ROOT / "docs" / "reference.md").read_text()
    section = page[page.index("## Settings") : page.index("## Management commands")]
    table = "\n".join(line for line in section.splitlines() if line.startswith("|"))
    assert table == k2b_settings.reference_table()


def test_the_pgbouncer_settings_pass_the_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DATABASE_URL", "postgres://app:pw@pgbouncer:6432/shop")
    monkeypatch.setenv("DATABASE_DIRECT_URL", "postgres://app:pw@db:5432/shop")
    shown = evaluate("docs/operations.md", "DATABASES = {", env=environ.Env())
    databases, k2b = shown["DATABASES"], shown["K2B_WORKFLOWS"]
    assert (databases["default"]["PORT"], databases["direct"]["PORT"]) == (6432, 5432)
    assert databases["direct"]["ENGINE"] == "django.db.backends.postgresql"
    errors = check_settings_with_databases(databases, k2b)
    assert errors == []
    # The check would refuse a LISTEN_DATABASE alias that DATABASES lacks.
    assert [e.id for e in check_settings_with_databases({"default": {}}, k2b)] == [
        "k2b_workflows.E009"
    ]


def test_the_multi_host_settings_of_high_availability_md_are_the_tested_ones() -> None:
    """What the page shows reaches psycopg as the failover and partition tests pass it."""
    from urllib.parse import unquote

    from django.db.utils import ConnectionHandler

    from tests.support.topology import CLIENT_TIMEOUTS

    shown = evaluate("docs/high-availability.md", "DATABASES = {")["DATABASES"]
    params = ConnectionHandler(shown)["default"].get_connection_params()
    # Two hosts, the writable one kept (tests/crash/test_failover.py's URL)...
    assert params["host"] == "db-a.internal,db-b.internal"
    assert params["target_session_attrs"] == "read-write"
    # ...and the timeouts tests/crash/test_partition.py measured.
    tested = {key: unquote(value) for key, value in CLIENT_TIMEOUTS.items()}
    assert {key: params[key] for key in tested} == tested
    assert check_settings_with_databases(shown, {}) == []


def test_the_prepared_statements_setting_of_performance_md_reaches_psycopg(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from django.db.utils import ConnectionHandler

    monkeypatch.setenv("DATABASE_URL", "postgres://app:pw@db:5432/shop")
    shown = evaluate("docs/performance.md", "DATABASES = {", env=environ.Env())["DATABASES"]
    # What Django hands to psycopg.connect() (nothing connects): on, where Django's
    # default is off.
    for options, expected in (shown["default"]["OPTIONS"], 5), ({}, None):
        handler = ConnectionHandler({"default": {**shown["default"], "OPTIONS": options}})
        assert handler["default"].get_connection_params()["prepare_threshold"] == expected
    assert check_settings_with_databases(shown, {}) == []


def check_settings_with_databases(databases: dict, k2b: dict) -> list:
    # check_settings reads settings.DATABASES; connections are not touched.
    with (
        pytest.warns(UserWarning, match="DATABASES"),
        override_settings(DATABASES=databases, K2B_WORKFLOWS=k2b),
    ):
        return check_settings()


def test_the_redaction_setting_is_known_and_passes_the_checks() -> None:
    first = 'K2B_WORKFLOWS = {"REDACT_HOOK": "myapp.redaction.hide_emails"}'
    shown = evaluate("docs/operators.md", first)["K2B_WORKFLOWS"]
    assert set(shown) <= store.known_settings()
    assert settings_errors(K2B_WORKFLOWS=shown) == []


def test_the_two_role_settings_pass_the_checks() -> None:
    shown = evaluate("docs/security.md", "# settings.py", env=lambda name: f"secret-{name}")
    databases, k2b = shown["DATABASES"], shown["K2B_WORKFLOWS"]
    assert {db["NAME"] for db in databases.values()} == {"shop"}
    assert (databases["default"]["USER"], databases["owner"]["USER"]) == ("k2b_app", "k2b_owner")
    assert databases["owner"]["TEST"] == {"MIRROR": "default"}
    assert check_settings_with_databases(databases, k2b) == []
    with override_settings(K2B_WORKFLOWS=k2b):
        assert (store.database(), store.owner_database()) == ("default", "owner")


@pytest.mark.django_db(transaction=True)
def test_the_witness_logging_of_security_md_writes_records(tmp_path: Path) -> None:
    import logging.config

    shown = evaluate("docs/security.md", "LOGGING = {")["LOGGING"]
    handler = shown["handlers"]["witness"]
    assert handler["filename"] == "/var/log/k2b/witness.log"
    handler["filename"] = str(tmp_path / "witness.log")
    logging.config.dictConfig({**shown, "disable_existing_loggers": False})
    log = logging.getLogger("k2b_workflows.witness")
    try:
        run = start_workflow_run("test.charge", {"amount": 1})
        run_until_idle()
    finally:
        for attached in list(log.handlers):
            log.removeHandler(attached)
            attached.close()
        log.setLevel(logging.NOTSET)
    text = (tmp_path / "witness.log").read_text()
    assert text.count(f'"run": "{run.pk}"') == 2  # the dispatch and the end
    out = io.StringIO()
    call_command("verifyworkflows", "--witness", str(tmp_path / "witness.log"), stdout=out)
    assert "2 witness records: 0 not held" in out.getvalue()


def test_the_plugin_line_of_testing_md_loads_the_fixtures_it_lists() -> None:
    import importlib

    shown = evaluate("docs/testing.md", 'pytest_plugins = ["k2b_workflows.pytest_plugin"]')
    (plugin,) = (importlib.import_module(name) for name in shown["pytest_plugins"])
    page = (ROOT / "docs" / "testing.md").read_text()
    listed = set(re.findall(r"^\| `(k2b_\w+)` \|", page, flags=re.M))
    assert listed, "the page's fixture table"
    assert all(callable(getattr(plugin, name, None)) for name in listed), listed


def test_the_test_settings_of_testing_md_are_the_suites() -> None:
    shown = evaluate("docs/testing.md", "# settings used by your test run")["K2B_WORKFLOWS"]
    assert shown.items() <= settings.K2B_WORKFLOWS.items()
    assert settings_errors(K2B_WORKFLOWS=shown) == []


# -- shell commands ----------------------------------------------------------------------------


def manage_py_lines() -> list[tuple[str, str]]:
    """(where, arguments after manage.py) of every manage.py line in a ```sh block."""
    found = []
    for code in blocks("sh"):
        for line in code.code.replace("\\\n", " ").splitlines():
            if "manage.py" not in line:
                continue
            words = shlex.split(line, comments=True)
            args = words[words.index("manage.py") + 1 :]
            found.append((code.where, " ".join(args)))
    return found


def test_every_manage_py_line_not_run_is_still_in_the_docs() -> None:
    shown = {args for _, args in manage_py_lines()}
    assert set(NOT_RUN) <= shown, set(NOT_RUN) - shown


@pytest.mark.django_db(transaction=True)
def test_the_manage_py_commands_of_the_docs_run_as_shown() -> None:
    commands = [(where, args) for where, args in manage_py_lines() if args not in NOT_RUN]
    run = {args for _, args in commands}
    assert {"runworkflows --app shop --burst", "workflowstatus", "verifyworkflows"} <= run
    with examples("getting_started"):
        done = start_workflow_run("shop.checkout", {"sku": "TEA-01", "amount": 2900})
        run_until_idle()
        assert_run_status(done, "succeeded")
        for i, where, args in [(i, *command) for i, command in enumerate(commands)]:
            if args.startswith("runworkflows"):  # something for the worker to do
                queued = start_workflow_run("shop.checkout", {"sku": f"T{i}", "amount": 100})
            out, err = io.StringIO(), io.StringIO()
            try:
                call_command(*shlex.split(args), stdout=out, stderr=err)
            except SystemExit as exc:  # commands that exit with a status
                assert exc.code in (0, None), (where, args, out.getvalue(), err.getvalue())
            if args.startswith("runworkflows"):
                assert_run_status(queued, "succeeded")
            if args.startswith("grantworkflows"):
                assert out.getvalue() == grant_statements_shown(), where
            if args.startswith("verifyworkflows"):
                assert WorkflowRun.objects.count() > 1
    # The finished runs are younger than 90 days: the purges kept them.
    assert WorkflowRun.objects.filter(pk=done.pk).exists()
    assert LedgerEntry.objects.filter(run=done).exists()


def grant_statements_shown() -> str:
    """The statements security.md says ``grantworkflows k2b_app`` prints."""
    text = (ROOT / "docs" / "security.md").read_text()
    after = text.split("`grantworkflows` prints (for the `public` schema):", 1)[1]
    return re.search(r"```sql\n(.*?)```", after, re.S).group(1)  # type: ignore[union-attr]


def makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([a-z][\w-]*):", text, re.M))


def test_every_make_target_the_docs_name_exists_and_make_help_lists_it() -> None:
    named = set()  # in inline code (`make docs`) and at the start of a shell line
    for path in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        named |= set(re.findall(r"(?:`|^)make ([a-z][\w-]*)", path.read_text(), re.M))
    named -= {"help"}  # the one that lists the others
    assert named, "the docs name make targets"
    help_text = subprocess.run(
        ["make", "-s", "help"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    for target in sorted(named):
        assert target in makefile_targets(), target
        # Listed as "make bench ... (full; bench-quick: under a minute)" counts too.
        assert re.search(rf"(?<![\w-]){re.escape(target)}(?![\w-])", help_text), target


def test_the_readme_quickstart_commands_run_the_demo_and_the_suite() -> None:
    shown = next(b for b in blocks("sh") if b.page == "README.md").code
    assert re.findall(r"^make (\w+)", shown, re.M) == ["demo", "test"]

    def recipe(target: str) -> str:
        return subprocess.run(
            ["make", "-n", target], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout

    # What `make demo` runs is what test_the_demo_settles_as_the_tutorial_says runs.
    assert re.search(r"manage\.py migrate --noinput && \S+ manage\.py demo$", recipe("demo"), re.M)
    assert "-m pytest" in recipe("test")


def test_the_tox_environments_of_the_readme_exist() -> None:
    readme = (ROOT / "README.md").read_text()
    named = set(re.findall(r"tox -e (\w+)", readme))
    assert named == {"django6", "django52"}
    tox = (ROOT / "tox.ini").read_text()
    for env in named:
        assert f"[testenv:{env}]" in tox


# -- the quickstart: an existing project adds the app ----------------------------------------


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_an_existing_project_with_its_own_databases_adds_the_app_as_getting_started_says(
    tmp_path: Path,
) -> None:
    """``startproject``, then the page's INSTALLED_APPS, DATABASES and witness LOGGING:
    check (no issues: W040 is silent once the witness goes somewhere), migrate, status."""
    subprocess.run(
        [sys.executable, "-m", "django", "startproject", "quicksite", str(tmp_path)],
        check=True,
    )
    apps = block("docs/getting-started.md", "INSTALLED_APPS = [").code
    databases = block("docs/getting-started.md", "DATABASES = {").code
    witness = block("docs/getting-started.md", ONE_LINE_WITNESS).code
    ours = connection.settings_dict
    name = f"{ours['NAME']}_quickstart"[:63]
    server = {
        "NAME": name,
        "USER": ours["USER"],
        "PASSWORD": ours["PASSWORD"] or "",
        "HOST": ours["HOST"] or "",
        "PORT": ours["PORT"] or "",
    }
    settings_py = tmp_path / "quicksite" / "settings.py"
    settings_py.write_text(
        settings_py.read_text()
        # The page's "...," stands for the project's own apps.
        + "\n"
        + apps.replace("    ...,\n", "    *INSTALLED_APPS,\n")
        + "\n"
        + databases
        + witness
        # Point the page's settings at this test server.
        + f"\nDATABASES['default'].update({server!r})\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in {"DJANGO_SETTINGS_MODULE"}}
    with connection.cursor() as cursor:
        cursor.execute(f'DROP DATABASE IF EXISTS "{name}"')
        cursor.execute(f'CREATE DATABASE "{name}"')
    try:

        def manage(*args: str) -> str:
            result = subprocess.run(
                [sys.executable, "manage.py", *args],
                cwd=tmp_path,
                env=env,
                capture_output=True,
                text=True,
            )
            assert result.returncode == 0, (args, result.stdout, result.stderr)
            return result.stdout + result.stderr

        assert "no issues" in manage("check")
        manage("migrate", "--noinput")
        assert "runs:" in manage("workflowstatus")
        manage("verifyworkflows")
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# -- the tutorial is the demo ---------------------------------------------------------------

DEMO_INPUTS = {
    "shop.checkout": {
        "sku": "TEA-01",
        "items": ["teapot", "cup"],
        "amount_cents": 2_900,
        "customer": "ada@example.com",
    },
    "shop.ship_item": {"order_id": 1, "item": "teapot"},
    "shop.payout": {"amount_cents": 12_500},
}


@pytest.mark.django_db
@pytest.mark.parametrize("name", sorted(DEMO_INPUTS))
def test_a_dry_run_of_every_demo_workflow_is_ok(name: str) -> None:
    report = dry_run(name, DEMO_INPUTS[name], principal={"user": "docs"})
    assert report.ok, [(s.seq, s.action, s.error) for s in report.steps]
    assert report.within_budget
    assert report.steps, "a dry run reports the planned steps"


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_the_demo_settles_as_the_tutorial_says(tmp_path) -> None:
    out = io.StringIO()
    log = tmp_path / "demo.log"
    call_command("demo", concurrency=2, timeout=120, log_file=log, stdout=out, stderr=out)
    text = out.getvalue()
    # The event lines went to the log file it names, not between its progress lines.
    assert f"The workers' log (every claim, step and ledger entry): {log}" in text
    assert "claimed (generation" in log.read_text()
    assert " INFO " not in text and "k2b_workflows.events" not in text, text
    assert "Started 7 runs" in text
    runs = WorkflowRun.objects.filter(parent__isnull=True)
    by_status = {
        status: runs.filter(status=status).count()
        for status in ("succeeded", "needs_attention", "canceled")
    }
    # Five checkouts (one reconciled after a provider timeout, two approved by a
    # person), the bank payout that only an operator can settle, one canceled.
    assert by_status == {"succeeded": 5, "needs_attention": 1, "canceled": 1}, text
    payout = runs.get(workflow_name="shop.payout")
    assert payout.error_code == "EFFECT_OUTCOME_UNKNOWN"
    kettle = runs.get(workflow_name="shop.checkout", input__sku="KETTLE")
    assert LedgerEntry.objects.filter(run=kettle, kind="outcome_unknown").exists()
    from example_project.demo.models import Payment

    # One charge per succeeded checkout, the timed-out one included.
    assert Payment.objects.count() == 5
    assert "Incidents waiting for an operator: 1" in text
    assert "/admin/k2b_workflows/incident/" in text


def test_the_tasks_setting_of_tasks_md_makes_the_backend() -> None:
    """The TASKS block of docs/tasks.md, evaluated: our backend, its queues, external by default."""
    from k2b_workflows.tasks import WorkflowsBackend

    namespace: dict[str, Any] = {}
    exec(block("docs/tasks.md", "# settings.py").code, namespace)
    params = namespace["TASKS"]["default"]
    assert params["BACKEND"] == "k2b_workflows.tasks.WorkflowsBackend"
    backend = WorkflowsBackend("default", params)
    assert backend.queues == {"default", "mail"}
    assert backend.default_effect == "external"


def test_the_tasks_you_do_not_own_of_tasks_md_make_the_backend() -> None:
    """The OPTIONS["tasks"] block of docs/tasks.md: the backend takes it, the most
    specific entry first, each naming the options it gives."""
    from k2b_workflows.tasks import WorkflowsBackend

    namespace: dict[str, Any] = {}
    exec(block("docs/tasks.md", "# settings.py: tasks you do not own").code, namespace)
    backend = WorkflowsBackend("default", namespace["TASKS"]["default"])
    found = {o.pattern: o.values for o in backend.overrides}
    assert backend.overrides[0].pattern == "shop.vendor.charge"
    assert found["wagtail.images.tasks.*"] == {"effect": "idempotent"}
    assert found["shop.vendor.charge"] == {"reconcile": "shop.reconciles.find_charge"}


def test_the_wagtail_settings_of_library_tasks_md_make_the_backend() -> None:
    """Both TASKS blocks of docs/library-tasks.md: every Wagtail task idempotent by its
    prefix, and a task's own entry winning over the prefix it is under."""
    from k2b_workflows.tasks import WorkflowsBackend

    namespace: dict[str, Any] = {}
    exec(block("docs/library-tasks.md", "# settings.py: Wagtail's tasks").code, namespace)
    backend = WorkflowsBackend("default", namespace["TASKS"]["default"])
    found = {o.pattern: o.values for o in backend.overrides}
    assert found == {
        "wagtail.*": {"effect": "idempotent"},
        "modelsearch.tasks.*": {"effect": "idempotent"},
    }
    assert backend.default_effect == "external"

    namespace = {}
    exec(
        block("docs/library-tasks.md", "# settings.py: one of Wagtail's tasks kept external").code,
        namespace,
    )
    backend = WorkflowsBackend("default", namespace["TASKS"]["default"])
    first = backend.overrides[0]
    assert first.pattern == "wagtail.tasks.delete_file_from_storage_task"
    assert first.values == {"effect": "external"}
