"""The quick soak: every effect class, waits and fan-out under kills, freezes and restarts.

``bench/soak.py --quick`` starts a PostgreSQL of its own (it restarts it, so never
the suite's server), three worker processes and a waker, and for about 35 seconds
SIGKILLs and SIGSTOPs workers, terminates backends and restarts PostgreSQL
(``-m fast``, then ``-m immediate``). The invariants are checked by the soak from
the database; this test reads its JSON report and requires each of them to be 0.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.crash]

ROOT = Path(__file__).resolve().parent.parent
INVARIANTS = (
    "lost",
    "duplicate_effects",
    "missing_effects",
    "stale_writes",
    "unchecked_writes",
    "broken_chains",
    "unexpected_attention",
    "died_on_their_own",
    "unclean_stops",
)


def test_quick_soak_keeps_every_invariant():
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "soak.py"), "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,  # generous: the machine is shared; the soak takes about 1.5 min idle
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("SOAK ")]
    assert lines, f"no report (exit {result.returncode}):\n{result.stdout}\n{result.stderr}"
    report = json.loads(lines[-1].removeprefix("SOAK "))

    # The chaos happened: a soak that killed nothing proves nothing.
    assert report["runs_started"] == 150
    assert report["runs_total"] > report["runs_started"]  # fan-out children
    assert report["kills"] >= 1 and report["freezes"] >= 1, report
    assert report["restart_modes"] == ["fast", "immediate"], report
    assert report["drained"], report

    violated = {name: report[name] for name in INVARIANTS if report[name] != 0}
    assert not violated, f"{violated}\n{result.stdout[-6000:]}"
    assert set(report["needs_attention_provider_calls"]) <= {"0", "1"}
    assert report["ok"] and result.returncode == 0, result.stdout[-3000:]
