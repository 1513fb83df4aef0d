"""Properties of canonical JSON, hashing, result validation and the boundary validators.

Generated values, not examples: equal JSON values hash equal whatever their
key order, every non-JSON value is refused, and whatever a validator accepts
PostgreSQL can store.
"""

from __future__ import annotations

import copy
import datetime as dt
import decimal
import json
import uuid

import pytest
from django.db import connection
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from k2b_workflows import InvalidInput, failed, succeeded
from k2b_workflows.actions import (
    Ambiguous,
    Dependency,
    Failed,
    InvalidResult,
    Succeeded,
    Waiting,
    validate_result,
)
from k2b_workflows.kernel.evidence import hash_value
from k2b_workflows.validation import (
    MAX_MESSAGE_CHARS,
    canonical_json,
    integer,
    run_id,
    storable_message,
    text,
    to_json_value,
)

settings.register_profile(
    "k2b", deadline=None, suppress_health_check=[HealthCheck.too_slow], max_examples=100
)
settings.load_profile("k2b")

finite_floats = st.floats(allow_nan=False, allow_infinity=False)
json_atoms = st.none() | st.booleans() | st.integers() | finite_floats | st.text()
json_values = st.recursive(
    json_atoms,
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=8), children, max_size=5)
    ),
    max_leaves=25,
)
storable_text = st.text().filter(lambda s: "\x00" not in s)
storable_values = st.recursive(
    st.none() | st.booleans() | st.integers() | finite_floats | storable_text,
    lambda children: (
        st.lists(children, max_size=5)
        | st.dictionaries(storable_text.filter(lambda s: len(s) < 9), children, max_size=5)
    ),
    max_leaves=25,
)
non_json_leaves = st.one_of(
    st.sets(st.integers(), max_size=2),
    st.binary(max_size=4),
    st.builds(object),
    st.complex_numbers(allow_nan=False),
    st.sampled_from([float("nan"), float("inf"), float("-inf")]),
    st.decimals(allow_nan=False, allow_infinity=False),
    st.datetimes(),
    st.builds(uuid.uuid4),
    st.dictionaries(
        st.integers() | st.none() | st.booleans() | st.tuples(st.integers()),
        st.integers(),
        min_size=1,
        max_size=2,
    ),
)


def reorder(value):
    """The same JSON value with every object's keys inserted in reverse order."""
    if isinstance(value, dict):
        return {k: reorder(value[k]) for k in reversed(list(value))}
    if isinstance(value, list):
        return [reorder(v) for v in value]
    return value


@st.composite
def with_a_non_json_leaf(draw):
    """A JSON value with one non-JSON value hidden somewhere in it."""
    bad = draw(non_json_leaves)
    value = draw(json_values)
    path = draw(st.lists(st.sampled_from(["list", "dict"]), max_size=4))
    for kind in path:
        bad = [value, bad] if kind == "list" else {"ok": value, "bad": bad}
    return bad


# -- canonical JSON and hashing ------------------------------------------------------


@given(json_values)
def test_equal_values_have_equal_canonical_text_and_hash(value):
    twin = copy.deepcopy(value)
    assert canonical_json(value) == canonical_json(twin)
    assert hash_value(value) == hash_value(twin)


@given(json_values)
def test_key_order_does_not_change_the_canonical_text_or_hash(value):
    assert canonical_json(reorder(value)) == canonical_json(value)
    assert hash_value(reorder(value)) == hash_value(value)


@given(json_values)
def test_canonical_text_round_trips_to_the_same_canonical_text(value):
    text_ = canonical_json(value)
    assert canonical_json(json.loads(text_)) == text_


@given(json_values, json_values)
def test_different_values_have_different_canonical_text(a, b):
    assume(canonical_json(a) != canonical_json(b))
    assert hash_value(a) != hash_value(b)


@given(with_a_non_json_leaf())
def test_every_non_json_value_is_refused(value):
    with pytest.raises(InvalidInput):
        canonical_json(value)
    with pytest.raises(InvalidInput):
        to_json_value(value, "the value")


def test_values_json_dumps_would_silently_change_are_refused():
    for value in ({1: "x"}, {True: 1}, {None: 1}, {(1,): 1}, {"a": {2.5: 1}}):
        with pytest.raises(InvalidInput, match="JSON object keys must be strings"):
            canonical_json(value)
    for value in (decimal.Decimal("1.5"), dt.date(2026, 1, 1), b"x", {1, 2}):
        with pytest.raises(InvalidInput, match="not a JSON value"):
            canonical_json([value])


# -- stored values ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def jsonb_read_back(django_db_setup, django_db_blocker):
    """What PostgreSQL gives back for a value stored as ``jsonb``: the oracle of
    ``to_json_value`` (a module's fixture: hypothesis runs many examples per test)."""
    with django_db_blocker.unblock():

        def read_back(value):
            with connection.cursor() as cursor:
                cursor.execute("SELECT %s::jsonb", [canonical_json(value)])
                return json.loads(cursor.fetchone()[0])

        yield read_back


@given(storable_values)
def test_a_storable_value_reads_back_equal(jsonb_read_back, value):
    stored = to_json_value(value, "v")
    assert canonical_json(stored) == canonical_json(jsonb_read_back(value))


@given(json_values, st.text(max_size=5))
def test_a_nul_anywhere_in_a_stored_value_is_refused_but_hashable(value, prefix):
    poisoned = {"wrapper": [value, prefix + "\x00"]}
    with pytest.raises(InvalidInput, match="contains a NUL character"):
        to_json_value(poisoned, "the input")
    assert to_json_value(poisoned, "a step input", stored=False) is not None
    with pytest.raises(InvalidInput, match="has a key with a NUL"):
        to_json_value({prefix + "\x00": value}, "the input")


# -- result validation -------------------------------------------------------------------


@given(storable_values, st.none() | storable_text)
def test_a_storable_output_is_a_valid_result_and_reads_back_equal(jsonb_read_back, output, summary):
    result = validate_result(succeeded(output, summary), (Succeeded,), "run")
    assert isinstance(result, Succeeded)
    assert canonical_json(result.output) == canonical_json(jsonb_read_back(output))


@given(with_a_non_json_leaf())
def test_a_non_json_output_is_an_invalid_result(output):
    with pytest.raises(InvalidResult):
        validate_result(succeeded(output), (Succeeded,), "run")


@given(st.text(), st.none() | st.text(min_size=1, max_size=120))
def test_a_failure_is_valid_with_any_message_and_a_storable_code(message, code):
    result = failed(message, code=code)
    code_ok = code is None or ("\x00" not in code and len(code) <= 100 and code.strip())
    if not code_ok:
        with pytest.raises(InvalidResult):
            validate_result(result, (Failed,), "run")
        return
    valid = validate_result(result, (Failed,), "run")
    assert isinstance(valid, Failed)
    assert "\x00" not in valid.message
    assert valid.message.replace("\\x00", "\x00")[:MAX_MESSAGE_CHARS] == message[:MAX_MESSAGE_CHARS]


@given(st.text(min_size=1), st.text(min_size=1))
def test_a_wait_is_valid_exactly_when_its_kind_and_key_fit_their_columns(kind, key):
    result = Waiting(Dependency(kind, key))

    def fits(value: str, length: int) -> bool:
        return bool(value.strip()) and "\x00" not in value and len(value) <= length

    if fits(kind, 200) and fits(key, 500) and _utf8(kind) and _utf8(key):
        assert validate_result(result, (Waiting,), "run") is result
    else:
        with pytest.raises(InvalidResult):
            validate_result(result, (Waiting,), "run")


@given(st.one_of(json_values, st.builds(object), st.just(Ambiguous())))
def test_anything_but_an_allowed_result_is_an_invalid_result(value):
    with pytest.raises(InvalidResult, match="expected one of: succeeded, failed"):
        validate_result(value, (Succeeded, Failed), "run")


# -- the boundary validators -------------------------------------------------------------


def _utf8(value: str) -> bool:
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return True


@given(st.text(max_size=300))
def test_text_is_accepted_exactly_when_a_varchar_column_can_store_it(value):
    ok = bool(value.strip()) and "\x00" not in value and len(value) <= 255 and _utf8(value)
    if ok:
        assert text(value, "idempotency_key", max_length=255) == value
    else:
        with pytest.raises(InvalidInput, match="idempotency_key"):
            text(value, "idempotency_key", max_length=255)


@given(st.text())
def test_a_stored_message_is_always_storable(message):
    stored = storable_message(message)
    assert "\x00" not in stored
    assert len(stored) <= MAX_MESSAGE_CHARS + 6
    stored.encode()


@given(st.booleans())
def test_a_boolean_is_never_a_number(value):
    with pytest.raises(InvalidInput, match="must be an int, not bool"):
        integer(value, "max_steps", minimum=0)


@given(st.integers())
def test_an_integer_is_accepted_exactly_within_its_bounds(value):
    if 1 <= value <= 2**31 - 1:
        assert integer(value, "max_steps", minimum=1, maximum=2**31 - 1) == value
    else:
        with pytest.raises(InvalidInput, match="max_steps must be between"):
            integer(value, "max_steps", minimum=1, maximum=2**31 - 1)


@given(st.uuids())
def test_a_run_id_is_accepted_as_uuid_or_text(value):
    assert run_id(value) == value
    assert run_id(str(value)) == value


@given(st.text() | st.integers() | st.none() | st.lists(st.integers(), max_size=2))
def test_anything_else_is_not_a_run_id(value):
    try:
        uuid.UUID(value)  # type: ignore[arg-type]
        assume(False)
    except (ValueError, TypeError, AttributeError):
        pass
    with pytest.raises(InvalidInput, match="parent is not a run id"):
        run_id(value, "parent")
