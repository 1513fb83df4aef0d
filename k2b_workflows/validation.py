"""The checks every value passes where it crosses into the kernel, before anything is written.

PostgreSQL refuses some values only when a statement runs: a NUL character
in ``text`` or ``jsonb`` (``DataError``), a string longer than its
``varchar`` column (``DataError``), a malformed UUID, an integer past
``bigint``, ``NULL`` in a ``NOT NULL`` column (``IntegrityError``). Reached
from user code those are tracebacks; reached from inside a run they are
worse: the step's transaction fails after the action ran, the worker treats
it as a crash, and the run retries until ``WORKFLOW_RETRY_EXHAUSTED`` with a
reason that blames the worker. So every boundary calls one of these first,
and each raises ``InvalidInput`` naming the field.
"""

from __future__ import annotations

import copy
import decimal
import json
import math
import uuid
from typing import Any

from .exceptions import InvalidInput

#: Deepest nesting of a JSON value. Python's encoder and PostgreSQL's jsonb
#: parser both recurse; a value nested 100,000 deep would exhaust either.
MAX_JSON_DEPTH = 100

#: Longest message the kernel stores (exception texts, failure messages): a
#: provider that raises with a 100 MB text must not fail the write of its failure.
MAX_MESSAGE_CHARS = 10_000

#: The one encoder of canonical JSON text (``json_text``, the evidence hashes):
#: sorted keys, no spaces, no NaN. Built once; ``json.dumps`` with arguments
#: builds an encoder per call, and a run encodes a few dozen small values.
#: (An encoder keeps no state between calls: threads may share it.)
CANONICAL_JSON = json.JSONEncoder(
    sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
)

#: Most digits of an integer in a JSON value. Python refuses to turn an int of
#: more than 4,300 digits into text (``sys.get_int_max_str_digits``), so a
#: larger one failed deep inside the encoder, with a ValueError that named no
#: field, and a workflow returning one left its run running.
MAX_INT_DIGITS = 4_000
_INT_BOUND = 10**MAX_INT_DIGITS

#: The largest integers PostgreSQL's ``bigint`` and ``integer`` hold.
MAX_BIGINT = 2**63 - 1
MAX_INT = 2**31 - 1

_ATOMS = (str, int, float, bool, type(None))


def _where(field: str, path: list[Any]) -> str:
    text = field + "".join(f"[{p!r}]" for p in path[:8])
    return text + ("[...]" if len(path) > 8 else "")


def check_json(value: Any, field: str, *, stored: bool = True) -> None:
    """Raise ``InvalidInput`` unless ``value`` is a JSON value (and, ``stored``, storable).

    JSON values: ``None``, ``bool``, ``int``, finite ``float``, ``str``, lists
    (and tuples, written as arrays) and dicts with ``str`` keys, nested at most
    ``MAX_JSON_DEPTH`` deep. ``json.dumps`` would turn ``{1: "x"}`` into
    ``{"1": "x"}`` and the workflow would fail on ``input[1]`` much later.
    Stored values may not contain NUL, which PostgreSQL's ``jsonb`` refuses.

    Hashing calls this for every step, so the walk is a plain loop; the path
    of a problem is only worked out once one is found.
    """
    if _valid(value, stored):
        return
    _explain(value, field, stored)


def _valid(value: Any, stored: bool) -> bool:
    stack: list[tuple[Any, int]] = [(value, 0)]
    pop, push = stack.pop, stack.append
    while stack:
        item, depth = pop()
        kind = type(item)
        if kind is str:
            if stored and "\x00" in item:
                return False
        elif kind is dict:
            if depth >= MAX_JSON_DEPTH:
                return False
            for key, child in item.items():
                if type(key) is not str or (stored and "\x00" in key):
                    return False
                push((child, depth + 1))
        elif kind is list or kind is tuple:
            if depth >= MAX_JSON_DEPTH:
                return False
            for child in item:
                push((child, depth + 1))
        elif kind is float:
            if not math.isfinite(item):
                return False
        elif kind is int:
            if not -_INT_BOUND < item < _INT_BOUND:
                return False
        elif kind is not bool and item is not None:
            return False  # subclasses and everything else: the careful walk decides
    return True


def _explain(value: Any, field: str, stored: bool) -> None:
    """Walk again, with paths, and raise for the first problem (subclasses of JSON types pass)."""
    stack: list[tuple[Any, list[Any]]] = [(value, [])]
    while stack:
        item, path = stack.pop()
        if len(path) > MAX_JSON_DEPTH:
            raise InvalidInput(f"{field} is nested deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(item, str):
            if stored and "\x00" in item:
                raise InvalidInput(f"{_where(field, path)} contains a NUL character")
        elif isinstance(item, float):
            if not math.isfinite(item):
                raise InvalidInput(f"{_where(field, path)} is {item!r}, which JSON cannot hold")
        elif isinstance(item, int) and not isinstance(item, bool):
            if not -_INT_BOUND < item < _INT_BOUND:
                raise InvalidInput(
                    f"{_where(field, path)} is an integer of more than {MAX_INT_DIGITS} digits"
                )
        elif isinstance(item, dict):
            for key, child in item.items():
                if not isinstance(key, str):
                    raise InvalidInput(
                        f"{_where(field, path)} has the key {key!r} ({type(key).__name__}): "
                        "JSON object keys must be strings"
                    )
                if stored and "\x00" in key:
                    raise InvalidInput(f"{_where(field, path)} has a key with a NUL character")
                stack.append((child, [*path, key]))
        elif isinstance(item, (list, tuple)):
            stack.extend((child, [*path, i]) for i, child in enumerate(item))
        elif not isinstance(item, _ATOMS):
            raise InvalidInput(
                f"{_where(field, path)} is a {type(item).__name__}, not a JSON value"
            )


def json_text(value: Any, field: str, *, stored: bool = True) -> str:
    """The canonical JSON text of ``value`` after ``check_json``; ``stored`` also checks the size.

    The size limit is the setting ``MAX_VALUE_BYTES`` (see ``store.py``).
    """
    check_json(value, field, stored=stored)
    text = CANONICAL_JSON.encode(value)
    if stored:
        from . import settings

        limit = settings.max_value_bytes()
        try:
            size = len(text.encode())
        except UnicodeEncodeError:
            raise InvalidInput(f"{field} contains an unpaired surrogate, not UTF-8 text") from None
        if size > limit:
            raise InvalidInput(
                f"{field} is {size} bytes as JSON, over the limit of {limit} "
                "(K2B_WORKFLOWS['MAX_VALUE_BYTES'])"
            )
    return text


def copy_json(value: Any) -> Any:
    """A deep copy of a JSON value as read back (dicts, lists, atoms), for code that may
    change it: a run's input and principal, a step's output.

    ``copy.deepcopy`` of the same value, at a fraction of its cost (every run pays
    several): a value parsed from JSON shares no part with another, so there is no
    memo to keep. Atoms are immutable and shared; anything else goes to ``deepcopy``.
    """
    kind = type(value)
    if kind is dict:
        return {key: copy_json(child) for key, child in value.items()}
    if kind is list:
        return [copy_json(child) for child in value]
    if kind is str or kind is int or kind is float or kind is bool or value is None:
        return value
    return copy.deepcopy(value)


def jsonb_number(text: str) -> float | int:
    """A JSON number with a fraction or an exponent, as it reads back from ``jsonb``.

    PostgreSQL stores it as ``numeric``, which keeps its decimal digits but
    prints no exponent and has no negative zero: ``1.5e-07`` reads back as
    ``0.00000015``, the same float, but ``1e+16`` (Python's text for every
    float of 1e16 or more) as ``10000000000000000``, an integer, and ``-0.0``
    as ``0.0``. A value hashed as the float would then not verify once read back.
    """
    mantissa, exponent_mark, exponent = text.lower().partition("e")
    if exponent_mark and len(mantissa.partition(".")[2]) <= int(exponent):
        return int(decimal.Decimal(text))
    number = float(text)
    return 0.0 if number == 0 else number


#: ``json.loads(text, parse_float=jsonb_number)``'s decoder, built once: ``loads`` with
#: an argument builds a decoder at every call, and every step's output is read back here.
_STORED_JSON = json.JSONDecoder(parse_float=jsonb_number)


def stored_json(text: str) -> Any:
    """The value of canonical JSON ``text`` as a ``jsonb`` column gives it back."""
    return _STORED_JSON.decode(text)


def canonical_json(value: Any) -> str:
    """The one JSON text of a value: sorted keys, no spaces, no NaN, string keys only.

    Raises ``InvalidInput`` (a ``ValueError``) for values JSON cannot hold,
    including ``{1: "x"}``, which ``json.dumps`` would silently turn into ``{"1": "x"}``.
    """
    return json_text(value, "value", stored=False)


def to_json_value(value: Any, what: str, *, stored: bool = True) -> Any:
    """Return ``value`` as it will read back from the database, or raise ``InvalidInput``.

    ``stored`` (the default): the value is written to a ``jsonb`` column, so
    NUL characters and values over ``MAX_VALUE_BYTES`` are refused as well, and
    numbers come back as ``jsonb`` gives them (``jsonb_number``):
    what a step returns, is hashed and is replayed is then one value.
    """
    text = json_text(value, what, stored=stored)
    return stored_json(text) if stored else json.loads(text)


def text(
    value: Any,
    field: str,
    *,
    max_length: int | None = None,
    required: bool = True,
) -> str:
    """A string that fits its column: non-empty (``required``), no NUL, at most ``max_length``."""
    if not isinstance(value, str):
        raise InvalidInput(f"{field} must be a string, not {type(value).__name__}")
    if required and not value.strip():
        raise InvalidInput(f"{field} must not be empty")
    if "\x00" in value:
        raise InvalidInput(f"{field} contains a NUL character")
    if max_length is not None and len(value) > max_length:
        raise InvalidInput(f"{field} is {len(value)} characters long, at most {max_length}")
    try:
        value.encode()
    except UnicodeEncodeError:
        raise InvalidInput(f"{field} contains an unpaired surrogate, not UTF-8 text") from None
    return value


#: The longest queue name: ``WorkflowRun.queue``'s and ``QueuePause.queue``'s length.
MAX_QUEUE_NAME = 100


def queue_name(value: Any, field: str = "queue") -> str:
    """A queue's name (``@workflow(queue=)``, ``start_workflow_run``, ``pause_queue``, #49):
    a non-empty string, not all whitespace, without NUL, at most ``MAX_QUEUE_NAME``."""
    return text(value, field, max_length=MAX_QUEUE_NAME)


def long_text(value: Any, field: str) -> str:
    """Free text stored in a ``text`` column (evidence, reasons): no NUL, within the size limit."""
    from . import settings

    text(value, field)
    limit = settings.max_value_bytes()
    if len(value.encode()) > limit:
        raise InvalidInput(f"{field} is over the limit of {limit} bytes")
    return value


def storable_message(message: Any) -> str:
    """A message the kernel writes (an exception text, a failure): made storable, never refused.

    The kernel records what went wrong even when the text itself is hostile:
    NUL and unpaired surrogates are escaped and the text is cut at
    ``MAX_MESSAGE_CHARS``. Refusing it would turn a failure into a crash.
    """
    message = message if isinstance(message, str) else str(message)
    if len(message) > MAX_MESSAGE_CHARS:
        message = message[:MAX_MESSAGE_CHARS] + " [...]"
    if "\x00" in message:
        message = message.replace("\x00", "\\x00")
    try:
        message.encode()
    except UnicodeEncodeError:
        message = message.encode("utf-8", "backslashreplace").decode()
    return message


def integer(
    value: Any, field: str, *, minimum: int = 0, maximum: int = MAX_BIGINT, optional: bool = False
) -> int | None:
    """An ``int`` (never a ``bool``: ``True`` is 1 to Python, a mistake to a budget)."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInput(f"{field} must be an int, not {type(value).__name__} {value!r}")
    if not minimum <= value <= maximum:
        raise InvalidInput(f"{field} must be between {minimum} and {maximum}, not {value}")
    return value


def run_id(value: Any, field: str = "run_id") -> uuid.UUID:
    """A run's id as a ``UUID``; a run instance gives its ``pk``."""
    pk = getattr(value, "pk", value)
    if isinstance(pk, uuid.UUID):
        return pk
    if isinstance(pk, str):
        try:
            return uuid.UUID(pk)
        except ValueError:
            pass
    raise InvalidInput(f"{field} is not a run id (a UUID): {value!r:.80}")


def child_inputs(inputs: Any, field: str) -> list[Any]:
    """One stored JSON value per child run (a child's input is never ``None``, like a root's)."""
    if isinstance(inputs, (str, bytes, dict)) or not hasattr(inputs, "__iter__"):
        raise InvalidInput(f"{field} must be a list of inputs, not {type(inputs).__name__}")
    values = list(inputs)
    for i, value in enumerate(values):
        if value is None:
            raise InvalidInput(f"{field}[{i}] is None: a child run needs an input")
    return stored_json(json_text(values, field))
