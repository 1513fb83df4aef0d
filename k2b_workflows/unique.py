"""``Unique``: what a task or a workflow declares about calls that repeat one another.

The failure this is built around: a "unique job" made by looking first and
inserting after. Two requests that enqueue the same rebuild at once both look,
both find nothing, and both insert; the lock-based designs that fix that drop
both calls when the first transaction rolls back (oban #1087). Here the key
is a column under a partial unique index (``kernel/uniques.py``): the second
insert waits for the first transaction, and finds its run if it committed,
or inserts its own if it rolled back.

A plain, validated value: a declaration that cannot mean anything (a key
not among the task's parameters, a ``max_wait`` shorter than the debounce)
is refused where it is written, naming what is wrong.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
from collections.abc import Sequence
from typing import Any

from . import validation
from .exceptions import InvalidInput

#: The states a run can hold its key in, in the order a run passes through them.
STATES = ("ready", "running", "successful", "failed")

#: The sets of states a declaration may name, each as the ``unique_states`` its runs
#: carry (the partial unique index of ``models.WorkflowRun`` reads them). A run holds
#: its key from its insert until it leaves them: the states are "ready" and those
#: after it without a gap, so a run never comes back into them after leaving
#: (it would then collide with the run that took the key meanwhile).
STATE_SETS: dict[frozenset[str], int] = {
    frozenset({"ready"}): 1,
    frozenset({"ready", "running"}): 2,
    frozenset({"ready", "running", "successful"}): 3,
    frozenset({"ready", "running", "failed"}): 4,
    frozenset({"ready", "running", "successful", "failed"}): 5,
}

#: The longest period and debounce a declaration may give: ten years.
MAX_PERIOD = dt.timedelta(days=3653)


@dataclasses.dataclass(frozen=True)
class Unique:
    """At most one run per key in ``states``, enqueued less than ``period`` ago.

    ``keys``: the names of the call's parameters that form the key (bound
    through the task's signature, so ``f(7)`` and ``f(site_id=7)`` are one
    key), or of a workflow's input fields; None: all of them. The task's path
    (a workflow's name) is always part of it. ``states``: where a run holds
    its key, "ready" and the states after it ("running", then "successful"
    and/or "failed"). ``period``: a run enqueued that long ago or more no
    longer holds it (None: at any age). ``replace``: a call matching a READY
    run gives it its arguments, priority and ``run_after``. ``debounce``: a
    call matching a READY run gives it its arguments and moves its
    ``run_after`` to now + ``debounce``, never past its first enqueue +
    ``max_wait``. A RUNNING run is never changed.
    """

    keys: Sequence[str] | None = None
    period: dt.timedelta | None = None
    states: Sequence[str] = ("ready", "running")
    replace: bool = False
    debounce: dt.timedelta | None = None
    max_wait: dt.timedelta | None = None

    def __post_init__(self) -> None:
        if self.keys is not None:
            if isinstance(self.keys, str) or not isinstance(self.keys, Sequence):
                raise InvalidInput(
                    f"Unique(keys=...) must be a list or tuple of parameter names, not "
                    f"{self.keys!r:.80}"
                    + (f": write keys=({self.keys!r},)" if isinstance(self.keys, str) else "")
                )
            keys = tuple(self.keys)
            if not keys:
                raise InvalidInput(
                    "Unique(keys=()) names no parameter: give one or more, or None for all"
                )
            for key in keys:
                if not isinstance(key, str) or not key.isidentifier():
                    raise InvalidInput(f"Unique(keys=...): {key!r:.80} is not a parameter name")
            if len(set(keys)) != len(keys):
                raise InvalidInput(f"Unique(keys=...) names a parameter twice: {keys}")
            object.__setattr__(self, "keys", keys)
        _duration(self.period, "period")
        states = self.states
        if isinstance(states, str) or not isinstance(states, Sequence):
            raise InvalidInput(
                f"Unique(states=...) must be a list or tuple of {STATES}, not {states!r:.80}"
            )
        unknown = [s for s in states if s not in STATES]
        if unknown:
            raise InvalidInput(
                f"Unique(states=...) names {unknown!r:.80}: the states are {', '.join(STATES)}"
            )
        if frozenset(states) not in STATE_SETS:
            raise InvalidInput(
                f"Unique(states={tuple(states)!r}): a run holds its key from its enqueue until "
                "it leaves its states, so they are 'ready' and the states after it without a "
                "gap: ('ready',), ('ready', 'running'), and 'successful' and/or 'failed' "
                "after those two"
            )
        object.__setattr__(self, "states", tuple(s for s in STATES if s in states))
        if not isinstance(self.replace, bool):
            raise InvalidInput(f"Unique(replace=...) must be True or False, not {self.replace!r}")
        _duration(self.debounce, "debounce")
        _duration(self.max_wait, "max_wait")
        if self.max_wait is not None:
            if self.debounce is None:
                raise InvalidInput(
                    "Unique(max_wait=...) bounds a debounce: give debounce= too, "
                    "or leave max_wait out"
                )
            if self.max_wait < self.debounce:
                raise InvalidInput(
                    f"Unique(max_wait={self.max_wait}) is shorter than its debounce "
                    f"({self.debounce}): the first call would already run later than max_wait"
                )

    @property
    def states_code(self) -> int:
        """The ``unique_states`` of its runs (``STATE_SETS``)."""
        return STATE_SETS[frozenset(self.states)]

    def key(self, kind: str, name: str, values: Any) -> str:
        """The key of a call of task or workflow ``name`` (``kind``) whose key
        values are ``values`` (JSON): a hash, the same for equal values in any
        key order."""
        text = validation.CANONICAL_JSON.encode([kind, name, values])
        return hashlib.sha256(text.encode()).hexdigest()


def check_unique(value: Any, where: str) -> Unique | None:
    """A declared ``unique``: a ``Unique(...)`` or None."""
    if value is None or isinstance(value, Unique):
        return value
    raise InvalidInput(f"{where}: unique must be a Unique(...), not {value!r:.80}")


def workflow_key_values(unique: Unique, input: Any, name: str) -> Any:
    """What of a workflow's ``input`` forms its key: the fields ``keys`` names, or
    all of it."""
    if unique.keys is None:
        return input
    if not isinstance(input, dict):
        raise InvalidInput(
            f"workflow {name!r}: Unique(keys={unique.keys}) names fields of the input, "
            f"which is not an object: {input!r:.80}"
        )
    missing = [k for k in unique.keys if k not in input]
    if missing:
        raise InvalidInput(
            f"workflow {name!r}: Unique(keys=...) names {missing}, which the input does not have"
        )
    return {k: input[k] for k in unique.keys}


def _duration(value: Any, field: str) -> None:
    if value is None:
        return
    if not isinstance(value, dt.timedelta):
        raise InvalidInput(f"Unique({field}=...) must be a timedelta or None, not {value!r:.80}")
    if value <= dt.timedelta(0):
        raise InvalidInput(f"Unique({field}=...) must be a positive timedelta, not {value}")
    if value > MAX_PERIOD:
        raise InvalidInput(f"Unique({field}=...) must be at most {MAX_PERIOD.days} days")
