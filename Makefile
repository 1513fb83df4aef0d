# Development tasks. Run `make help` for the list.
#
# The database: if DATABASE_URL is set in the environment it is used as is.
# Otherwise scripts/dbenv.py starts an embedded PostgreSQL with its data in
# .pgdata/ (left running between runs; `make db-stop` stops it) and the URL of
# its `k2b_workflows` database is exported to the commands below.

SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.k2b-installed
PYTEST_ARGS ?=
# The suite runs in TEST_WORKERS processes (pytest-xdist), each on a test database
# of its own. Most tests wait on worker subprocesses and PostgreSQL, so more
# processes than cores pay; TEST_WORKERS=0 runs it in one process. Tests go out
# one at a time, longest first (tests/conftest.py), so that no worker queues them.
TEST_WORKERS ?= 4
XDIST = -n $(TEST_WORKERS) --dist load --maxschedchunk 1

# Prefix for a recipe line that needs a database: sets and exports DATABASE_URL,
# and stops the recipe if no database could be had.
WITH_DB = url="$$($(PY) scripts/dbenv.py)" || exit $$?; export DATABASE_URL="$$url";

.PHONY: help venv dist db db-stop demo serve screenshots test test-pgbouncer test-fast mutants lint format bench bench-quick bench-overview compare soak docs docs-serve clean distclean

help:
	@echo "make demo      set everything up and run the demo workflows with real workers"
	@echo "make serve     run the example site (admin at http://127.0.0.1:8000/admin/)"
	@echo "make screenshots  the docs' admin pictures (docs/images/), from the demo in headless Chromium"
	@echo "make test      run the test suite on PostgreSQL in TEST_WORKERS=4 processes, with coverage (PYTEST_ARGS='-k foo')"
	@echo "make test-fast the suite without crash, slow and browser tests (the inner loop)"
	@echo "make test-pgbouncer the crash, waits, survive and hot-path tests through PgBouncer (POOL_MODE=session)"
	@echo "make mutants   remove each named guard in a copy of the tree; fail if no test notices"
	@echo "make lint      ruff check, ruff format --check, mypy, the import layers, no missing migration"
	@echo "make format    ruff format and ruff check --fix"
	@echo "make bench     run bench/run.py (full; bench-quick: under a minute)"
	@echo "make bench-overview time the admin's overview on 1,000,000 runs"
	@echo "make compare   the same workload on DBOS and Procrastinate (needs the bench extra)"
	@echo "make soak      the quick chaos soak, ~1.5 min (docs/soak.md); SOAK_ARGS= the long one, 8-13 min;"
	@echo "               SOAK_ARGS='--starve --quick' starvation, ~1.5 min; SOAK_ARGS=--starve 10 min of it"
	@echo "make docs      build the documentation site into build/site (strict: a warning fails)"
	@echo "make docs-serve serve the documentation at http://127.0.0.1:8001/ while you edit it"
	@echo "make venv      create .venv and install the project with its dev extras"
	@echo "make dist      build the wheel and sdist into dist/ and check them with twine"
	@echo "make db        start the embedded PostgreSQL (unless DATABASE_URL is set) and print its URL"
	@echo "make db-stop   stop the embedded PostgreSQL"
	@echo "make clean     remove build and cache files (keeps .venv and .pgdata)"
	@echo "make distclean clean, stop the embedded PostgreSQL, remove .venv, .pgdata and .tox"

venv: $(STAMP)

# Re-installed when pyproject.toml changes, and once k2b_workflows/__init__.py
# appears (an editable install made before it existed maps the package as a
# namespace package, which Django rejects).
$(STAMP): pyproject.toml $(wildcard k2b_workflows/__init__.py)
	@test -x $(PY) || { echo "creating $(VENV) with $(PYTHON)"; $(PYTHON) -m venv $(VENV); }
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -e '.[dev]'
	@touch $@

# The package is not on PyPI yet: this wheel (or a VCS URL) is how a site installs it
# (docs/getting-started.md). tests/docs/test_wheel.py builds one, checks that it holds
# every file of the package and installs it into a bare venv.
# The wheel needs build and twine, not the development environment (selenium,
# mkdocs, mypy...): a venv of its own with those two.
DIST_VENV ?= .venv-dist
$(DIST_VENV)/bin/python:
	$(PYTHON) -m venv $(DIST_VENV)
dist: $(DIST_VENV)/bin/python
	@$(DIST_VENV)/bin/python -m pip install -q --disable-pip-version-check build twine
	rm -rf build dist
	$(DIST_VENV)/bin/python -m build --outdir dist .
	$(DIST_VENV)/bin/python -m twine check --strict dist/*

db: venv
	@$(WITH_DB) echo "DATABASE_URL=$$DATABASE_URL"

db-stop:
	@if [ -x $(PY) ]; then $(PY) scripts/dbenv.py stop; fi

demo: venv db
	@$(WITH_DB) $(PY) manage.py migrate --noinput && $(PY) manage.py demo

serve: venv db
	@$(WITH_DB) $(PY) manage.py migrate --noinput && $(PY) manage.py runserver

# Needs chromium and chromedriver (Debian: apt-get install chromium chromium-driver).
screenshots: venv db
	@$(WITH_DB) $(PY) scripts/screenshots.py

# Coverage of the package, worker subprocesses included ([tool.coverage.run] in
# pyproject.toml). The whole suite must not fall below COVERAGE_FLOOR percent (93.6
# when the floor was set: raise it as tests are added); a run narrowed with
# PYTEST_ARGS only reports.
COVERAGE_FLOOR ?= 93
COVERAGE = --cov --cov-report=term $(if $(PYTEST_ARGS),,--cov-fail-under=$(COVERAGE_FLOOR))
test: venv db
	@$(WITH_DB) $(PY) -m pytest $(XDIST) $(COVERAGE) $(PYTEST_ARGS)

# The crash, waits, survive and hot-path tests with the database through a PgBouncer
# of their own (tests/support/pgbouncer.py), POOL_MODE=transaction (the documented
# settings) or session.
POOL_MODE ?= transaction
POOLED_TESTS = tests/crash/test_crash.py tests/kernel/test_waits.py tests/crash/test_survive.py tests/hot_path
test-pgbouncer: venv db
	@$(WITH_DB) $(PY) -m tests.support.pgbouncer $(POOL_MODE) -- $(PY) -m pytest $(XDIST) $(POOLED_TESTS) $(PYTEST_ARGS)

# The inner loop: no killed workers, no soak, no stress, no browser.
test-fast: venv db
	@$(WITH_DB) $(PY) -m pytest $(XDIST) -m "not crash and not slow and not browser" $(PYTEST_ARGS)

# Each guard (fence, lease holder, chain, anchor, seals, dedup, idempotency, re-dispatch,
# poll and attempt bounds, pinned search_path, witness) removed, one at a time, against
# the tests named for it; MUTANTS_ARGS=--full runs the whole fast suite for each.
MUTANTS_ARGS ?=
mutants: venv db
	@$(WITH_DB) $(PY) scripts/mutants.py $(MUTANTS_ARGS)

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	@# django-stubs' plugin loads tests.settings, which wants a DATABASE_URL; mypy never connects.
	DATABASE_URL="$${DATABASE_URL:-postgres://localhost/unused}" $(VENV)/bin/mypy
	$(VENV)/bin/lint-imports
	@$(WITH_DB) $(PY) manage.py makemigrations --check --dry-run

format: venv
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

bench: venv db
	@$(WITH_DB) $(PY) bench/run.py

bench-quick: venv db
	@$(WITH_DB) $(PY) bench/run.py --quick

bench-overview: venv db
	@$(WITH_DB) $(PY) bench/overview.py

compare: venv db
	$(PY) -m pip install -q -e '.[bench]'
	@$(WITH_DB) $(PY) bench/compare.py

# The soak starts and restarts a PostgreSQL of its own: it needs no DATABASE_URL.
# SOAK_ARGS: --quick (the default, what CI runs), empty for the long chaos soak,
# --starve [--quick] for the starvation soak, which keeps every core busy while it
# runs (docs/soak.md).
SOAK_ARGS ?= --quick
soak: venv
	$(PY) bench/soak.py $(SOAK_ARGS)

# NO_MKDOCS_2_WARNING silences a banner about MkDocs' future that is not a build warning.
docs: venv
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

docs-serve: venv
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve --dev-addr 127.0.0.1:8001

clean:
	rm -rf build dist *.egg-info .pytest_cache .ruff_cache test-artifacts staticfiles .coverage .coverage.*
	find . -path ./.venv -prune -o -path ./.tox -prune -o -path ./.pgdata -prune -o \
		-name __pycache__ -type d -exec rm -rf {} +

distclean: db-stop clean
	rm -rf $(VENV) $(DIST_VENV) .pgdata .tox
