"""The benchmark's smoke run at its smallest sizes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from django.db import connection

from tests.support.processes import ROOT, direct_connection_only

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.slow
@direct_connection_only
# The bench runs pgbench and every class of step: on a loaded machine it takes longer
# than pytest's default 300 s, which would fail it for the load, not for the bench.
@pytest.mark.timeout(900)
def test_bench_quick_prints_one_json_line_with_the_numbers():
    """A smoke run at the smallest sizes: no timing asserted, only that it runs and reports."""
    url = os.environ.get("DATABASE_URL")
    if not url:
        pytest.skip("DATABASE_URL is not set")
    from bench.run import with_db

    # Databases of its own, named after the test database: never a developer's bench.
    url = with_db(url, connection.settings_dict["NAME"])
    proc = subprocess.run(
        [
            *(sys.executable, str(ROOT / "bench" / "run.py"), "--quick", "--runs", "3"),
            *("--rounds", "2", "--wakes", "2", "--fanout", "3", "--processes", "1"),
        ],
        cwd=ROOT,
        # Not measured by make test's coverage: the bench's workers run code the
        # rest of the suite covers, and tracing them only made this test slower.
        env={**_without_coverage(os.environ), "DATABASE_URL": url},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in (
        "steps_per_s",
        "workflows_per_s",
        "commits_per_step",
        "pgbench_tps",
        "ratio_to_pgbench",
        "wake_p50_ms",
        "wake_p99_ms",
        "effects",
        "fanout",
        "processes",
        "pgbench_cpu_us_per_tx",
        "round_trips_per_step",
    ):
        assert key in result, key
    # Counted in-process, so exact: a 3-step PURE run's one round trip after its claim.
    assert result["round_trips_per_step"]["PURE"] == 0.33
    for measured in result["effects"].values():
        assert {"worker_cpu_us_per_step", "server_cpu_us_per_step"} <= set(measured)
    assert set(result["effects"]) == {"PURE", "TRANSACTIONAL", "IDEMPOTENT", "EXTERNAL", "MIX"}
    for measured in result["effects"].values():
        assert len(measured["rounds"]) == 2 and measured["vs_pure"] > 0
    assert result["effects"]["PURE"]["vs_pure"] == 1
    assert result["fanout"]["children"] == 3


def _without_coverage(environ: os._Environ[str]) -> dict[str, str]:
    """``environ`` less the variables that start coverage in a subprocess."""
    return {
        name: value
        for name, value in environ.items()
        if name not in {"COVERAGE_PROCESS_CONFIG", "COVERAGE_PROCESS_START"}
    }
