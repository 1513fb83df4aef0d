"""How a run's failure count is set back: only by the kernel, each time under a new seal (#47).

The failure this module is built around: ``consecutive_failures`` is what ends
a run's retries, and the runtime role may update run rows. Setting it back to
0 while a run waited for its retry ran a step bounded to 3 attempts 213 times
in 10 seconds, and an EXTERNAL task that raised after charging was called 106
times; no budget bounded it and ``verifyworkflows`` saw nothing.

Raising the count is harmless (retries end sooner), and a crash's takeover
raises it in SQL. Lowering it is what the kernel alone may do: when a step
completes after failures, when a step parks, when an operator retries or
settles a run. Each of those writes a new ``attempts_seq`` with its seal
(``seals.attempts_seal``) in the same UPDATE; the database refuses a lower
count under the same number and a number that goes down (the run's triggers),
and a claim refuses a number without its seal before any step runs. A reset
forged as the runtime role is therefore refused when written, or, written with
a number of its own, at the next claim: an incident, and a ``verifyworkflows``
line.

A claim prepares its one reset when it loads a run with failures (``for_run``):
every write that completes a step carries it (``SET``), and it applies only
while the row still counts failures, so the first such write resets and the
rest leave the row as it is. A run claimed without failures carries none: its
count can only have been raised since, and stays raised.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

from . import seals

if TYPE_CHECKING:
    from ..models import WorkflowRun


class Reset(NamedTuple):
    """A reset of a run's failures the kernel may write: its new number and that number's seal."""

    seq: int
    seal: str


_WHEN = "%s::bigint IS NOT NULL AND consecutive_failures > 0"

#: The part of a fenced UPDATE of a run that resets its failures: parameters ``params``.
SET = (
    f"consecutive_failures = CASE WHEN {_WHEN} THEN 0 ELSE consecutive_failures END,"
    f" attempts_seal = CASE WHEN {_WHEN} THEN %s ELSE attempts_seal END,"
    f" attempts_seq = CASE WHEN {_WHEN} THEN %s ELSE attempts_seq END"
)

#: The same, unconditional: an operator puts a run back in line (parameters ``params``
#: of ``next_for``), whatever it counted, with a new number even at 0: a run that
#: failed or needed an operator is queued again only under a new number.
SET_ALWAYS = "consecutive_failures = 0, attempts_seal = %s, attempts_seq = %s"


def params(reset: Reset | None) -> list[Any]:
    """The parameters of ``SET`` for ``reset`` (None: reset nothing)."""
    seq, seal = reset if reset is not None else (None, None)
    return [seq, seq, seal, seq, seq]


def always_params(reset: Reset) -> list[Any]:
    """The parameters of ``SET_ALWAYS``."""
    return [reset.seal, reset.seq]


def next_for(run_id: Any, seq: int) -> Reset:
    """The reset after number ``seq`` of the run ``run_id``."""
    return Reset(seq + 1, seals.attempts_seal(run_id, seq + 1))


def for_run(run: WorkflowRun) -> Reset | None:
    """The reset a claim of ``run`` (as loaded) carries, or None when it counts no failure."""
    if not run.consecutive_failures:
        return None
    return next_for(run.pk, run.attempts_seq)
