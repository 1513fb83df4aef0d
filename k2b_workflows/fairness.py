"""``Fairness``: what a task or a workflow declares about sharing its queue between keys.

The failure this is built around: one tenant's backlog of 100,000 runs,
claimed in line order, delays every other tenant's first run until it has
drained. A key's runs here take turns with the other keys' among the ready
runs of one queue and priority (weighted round-robin): each run's place in
line is its key's previous place plus a step (``1 / weight``), but never
earlier than the head of the queue, so a key that had nothing queued goes
next (``k2b_fair_line``, migration 0036, computes the place in the database,
when ``triggers.FairLine`` fires).

A plain, validated value: a declaration that cannot mean anything (a key
that is not among the task's parameters, a weight of zero) is refused where
it is written, naming what is wrong.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from . import validation
from .exceptions import InvalidInput

#: The longest key value, in characters (``k2b_run.fairness_key``).
MAX_KEY_LENGTH = 200

#: The lightest and heaviest weight. A key of weight ``w`` takes ``w`` turns to a
#: weight-1 key's one; the place in line is kept to the microsecond, so above 100
#: two weights would round to the same step.
MIN_WEIGHT = 0.01
MAX_WEIGHT = 100.0


@dataclasses.dataclass(frozen=True)
class Fairness:
    """Runs of one queue and priority take turns by ``key``, weighted by ``weights``.

    ``key``: the name of the task's parameter whose value is the key (e.g.
    ``"tenant_id"``), or of the field of a workflow's input (a start's
    ``fairness_key=`` gives it directly). ``weights``: key value -> weight
    (default 1): a key of weight 3 gets three turns to a weight-1 key's one.
    """

    key: str
    weights: Mapping[str, float] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.key, str) or not self.key.isidentifier():
            raise InvalidInput(
                f"Fairness(key=...) must name a parameter (an identifier), not {self.key!r:.80}"
            )
        if self.weights is None:
            return
        if not isinstance(self.weights, Mapping):
            raise InvalidInput(
                f"Fairness(weights=...) must be a dict of key -> weight, not {self.weights!r:.80}"
            )
        checked = {}
        for name, weight in self.weights.items():
            if not isinstance(name, str):
                raise InvalidInput(
                    f"Fairness(weights=...): the key {name!r:.80} is not a string "
                    "(key values are compared as text)"
                )
            checked[name] = check_weight(weight, f"Fairness(weights=...)[{name!r:.80}]")
        object.__setattr__(self, "weights", checked)

    def weight(self, key: str) -> float:
        """The weight of key value ``key`` (1 when ``weights`` does not name it)."""
        return 1.0 if self.weights is None else self.weights.get(key, 1.0)


def check_weight(value: Any, where: str) -> float:
    """A weight: a number from ``MIN_WEIGHT`` to ``MAX_WEIGHT``."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidInput(f"{where}: a weight must be a number, not {value!r:.80}")
    if not MIN_WEIGHT <= value <= MAX_WEIGHT:
        raise InvalidInput(
            f"{where}: a weight must be from {MIN_WEIGHT} to {MAX_WEIGHT:g}, not {value!r}"
        )
    return float(value)


def check_fairness(value: Any, where: str) -> Fairness | None:
    """A declared ``fairness``: a ``Fairness(...)`` or None."""
    if value is None or isinstance(value, Fairness):
        return value
    raise InvalidInput(f"{where}: fairness must be a Fairness(...), not {value!r:.80}")


def key_text(value: Any, where: str) -> str:
    """A key value as the text runs are grouped by: a string as it is, any other
    JSON value as its canonical JSON (so ``7`` and ``"7"`` are two keys)."""
    text = value if isinstance(value, str) else validation.CANONICAL_JSON.encode(value)
    if not text:
        raise InvalidInput(f"{where}: the fairness key is empty")
    if len(text) > MAX_KEY_LENGTH:
        raise InvalidInput(
            f"{where}: the fairness key is {len(text)} characters long, "
            f"longer than {MAX_KEY_LENGTH}: {text!r:.80}"
        )
    return text


def of_workflow_run(
    fairness: Fairness | None, input: Any, given: Any, name: str
) -> tuple[str, float] | None:
    """The key and weight by which a workflow's run takes turns: the key ``given``
    (``fairness_key=``), else the input's field that ``fairness.key`` names; None:
    the run takes none."""
    key = _workflow_key(fairness, input, given, name)
    if key is None:
        return None
    return key, 1.0 if fairness is None else fairness.weight(key)


def _workflow_key(fairness: Fairness | None, input: Any, given: Any, name: str) -> str | None:
    where = f"workflow {name!r}"
    if given is not None:
        return key_text(given, f"{where}: fairness_key")
    if fairness is None:
        return None
    if not isinstance(input, dict) or fairness.key not in input:
        raise InvalidInput(
            f"{where}: Fairness(key={fairness.key!r}) names a field of the input, which "
            f"{'does not have it' if isinstance(input, dict) else 'is not an object'}"
            ": give the field, or fairness_key= at the start"
        )
    return key_text(input[fairness.key], f"{where}: the input's {fairness.key!r}")
