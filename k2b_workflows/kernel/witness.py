"""The witness: each dispatch and each run's end, told to a sink outside the database.

The failure this is built around: everything in the database can be rolled
back together. An owner without the evidence key saved a queued run's
anchors, let it charge, deleted its journal, ledger and charges, wrote the
saved anchors back and queued it again: the replay charged a second time and
every chain verified, because the database was exactly as it had been before
the run started. A restored backup, or a standby promoted after losing its
last moments, does the same with no one's intent. No check inside the
database can tell; a record of what happened that lives outside it can.

Each record is a JSON object, keyed (``mac`` under the evidence keys, so a
line nobody with the key wrote is reported as forged, not believed):

- ``dispatch``: run, step, generation, and the ledger's length and head once
  the "dispatched" entry committed, told before the provider is called;
- ``end``: run, status, generation and the ledger's length and head once the
  run's end committed (succeeded, failed, canceled, needs_attention).

The sink is ``K2B_WORKFLOWS["WITNESS_SINK"]``, or the ``k2b_workflows.witness``
logger at INFO (a line ``k2b-witness {...}``), which the host ships to a log
store. ``manage.py verifyworkflows --witness FILE`` reads such lines back and
reports every witnessed run the database no longer holds, or holds at an
older point (a shorter ledger, another entry where the witnessed one was, a
lower generation, a final status undone).
"""

from __future__ import annotations

import hmac
import json
import logging
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from .. import settings
from . import db, evidence, hashing
from .keys import evidence_keys

#: Named, not ``__name__``: the ``WITNESS_SINK`` setting and the docs name it.
logger = logging.getLogger("k2b_workflows.witness")

MARK = "k2b-witness"
#: ``json.dumps(record, sort_keys=True)``'s encoder, built once: the line's text
#: is the same as ever (log searches and parsers match it), without an encoder
#: made for every record.
_LINE_JSON = json.JSONEncoder(sort_keys=True)
_FINAL = {"succeeded", "canceled"}


def _enabled() -> Any:
    """The sink to call, ``logger`` for the logger, or None when nobody listens."""
    sink = settings.witness_sink()
    if sink is not None:
        return sink
    return logger if logger.isEnabledFor(logging.INFO) else None


def goes_somewhere() -> bool:
    """Whether a witness record would leave the process: a sink, or a handler at INFO.

    The records are the only detection of an owner's rollback or a restored
    backup (#35): with no ``WITNESS_SINK`` and no handler of the
    ``k2b_workflows.witness`` logger (or of an ancestor it propagates to) that
    takes INFO, they go nowhere, and nothing said so. ``logging.lastResort``
    takes WARNING and up only, and a ``NullHandler`` drops them: neither counts.
    """
    if settings.witness_sink() is not None:
        return True
    if not logger.isEnabledFor(logging.INFO):
        return False
    current: logging.Logger | None = logger
    while current is not None:
        for handler in current.handlers:
            if handler.level <= logging.INFO and not isinstance(handler, logging.NullHandler):
                return True
        current = current.parent if current.propagate else None
    return False


def _mac(body: dict[str, Any], keys: Iterable[tuple[str, bytes]]) -> Iterator[str]:
    text = hashing.canonical({k: v for k, v in body.items() if k != "mac"})
    for key_id, key in keys:
        yield f"{key_id}:{hashing.hmac_hex(key, text)}"


def _tell(record: dict[str, Any]) -> None:
    """MAC the record and hand it to the sink: once per run's end and per dispatch.

    Built for its cost, every run pays it: the record is fresh (no ``mac`` key
    to leave out, so no copy before the MAC), and the logger's line is its
    ``json.dumps(record, sort_keys=True)`` by an encoder built once, passed as
    the message itself (no ``%`` formatting, no stack walk for the caller).
    The line, its content and its MAC are the same as before.
    """
    sink = _enabled()
    if sink is None:
        return
    record = {"k2b_witness": 1, **record}
    key_id, key = hashing.signing_key()
    record["mac"] = f"{key_id}:{hashing.hmac_hex(key, hashing.canonical(record))}"
    try:
        if sink is logger:
            # ``logger.handle`` of a record made here: what ``logger.info`` does
            # (the logger's filters, handlers and propagation) without looking up
            # the caller's file and line in the stack, the most costly part of a
            # log call; the record names this module, not a line of it.
            logger.handle(
                logger.makeRecord(
                    logger.name,
                    logging.INFO,
                    __file__,
                    0,
                    MARK + " " + _LINE_JSON.encode(record),
                    None,
                    None,
                    "_tell",
                )
            )
        else:
            sink(record)
    except Exception:  # a sink's failure never stops a run: say so, loudly
        logger.exception("run %s: the witness sink failed", record.get("run"))


def dispatched(
    run_id: uuid.UUID, seq: int, generation: int, ledger_count: int, ledger_head: str | None
) -> None:
    """A "dispatched" entry committed; the provider is about to be called."""
    _tell(
        {
            "kind": "dispatch",
            "run": str(run_id),
            "seq": seq,
            "generation": int(generation),
            "ledger": int(ledger_count),
            "head": ledger_head or evidence.GENESIS,
        }
    )


def ended(
    run_id: uuid.UUID, status: str, generation: int, ledger_count: int, ledger_head: str | None
) -> None:
    """The run's end (or its hand-over to an operator) committed."""
    _tell(
        {
            "kind": "end",
            "run": str(run_id),
            "status": status,
            "generation": int(generation),
            "ledger": int(ledger_count),
            "head": ledger_head or evidence.GENESIS,
        }
    )


# -- reading a witness back ------------------------------------------------


@dataclass
class Finding:
    """A witnessed record the database contradicts (or a line that is not a witness's)."""

    run: str
    text: str

    def __str__(self) -> str:
        return f"{self.run}: {self.text}"


def parse(lines: Iterable[str]) -> Iterator[dict[str, Any] | str]:
    """The witness records in log lines: plain ``... k2b-witness {...}`` lines, or JSON log
    lines whose ``message`` holds one. A marked line whose record does not decode is
    yielded as a description of it."""
    marker = MARK + " {"
    for number, line in enumerate(lines, start=1):
        if MARK not in line:
            continue
        text = line.strip()
        if text.startswith("{"):  # a JSON formatter: the record is inside the message
            try:
                message = json.loads(text).get("message", "")
            except (ValueError, AttributeError):
                message = ""
            if isinstance(message, str) and marker in message:
                text = message
        start = text.find(marker)
        if start < 0:
            yield f"line {number}: not a witness record"
            continue
        try:
            record, _ = json.JSONDecoder().raw_decode(text[start + len(MARK) + 1 :])
        except ValueError:
            record = None
        if isinstance(record, dict) and record.get("k2b_witness") == 1:
            yield record
        else:
            yield f"line {number}: not a witness record"


def _authentic(record: dict[str, Any]) -> bool:
    mac = record.get("mac")
    return isinstance(mac, str) and any(
        hmac.compare_digest(mac, m) for m in _mac(record, evidence_keys())
    )


_HELD_SQL = """
SELECT w.run, w.position, r.status, r.generation,
       (SELECT count(*) FROM k2b_ledger l WHERE l.run_id = w.run),
       (SELECT l.entry_hash FROM k2b_ledger l WHERE l.run_id = w.run
         ORDER BY l.id OFFSET GREATEST(w.position - 1, 0) LIMIT 1)
  FROM unnest(%s::uuid[], %s::int[]) AS w(run, position)
  LEFT JOIN k2b_run r ON r.id = w.run
"""


def check(lines: Iterable[str], using: str) -> tuple[int, list[Finding]]:
    """Hold the witness ``lines`` against the database: (records read, findings).

    Every witnessed ledger entry must still be where it was (the ledger is
    append-only: an entry that moved or vanished was rolled back), every run
    at least at its witnessed generation, and a run witnessed ending for good
    (succeeded, canceled) still ended so. Runs ``purgeworkflows`` deleted are
    witnessed as purged and not reported.
    """
    findings: list[Finding] = []
    records = []
    for item in parse(lines):
        if isinstance(item, str):
            findings.append(Finding("-", item))
            continue
        try:
            run = str(uuid.UUID(str(item["run"])))
            ok = item["kind"] in ("dispatch", "end", "purged") and all(
                isinstance(item.get(k), int) for k in ("ledger", "generation")
            )
        except (KeyError, ValueError, TypeError):
            ok = False
        if not ok or not _authentic(item):
            findings.append(
                Finding(str(item.get("run", "-")), "a witness record whose mac does not verify")
            )
            continue
        records.append({**item, "run": run})
    purged = {r["run"] for r in records if r["kind"] == "purged"}
    held = [r for r in records if r["run"] not in purged]
    # One row per witnessed (run, ledger position): the database's entry there.
    points = sorted({(r["run"], r["ledger"]) for r in held})
    rows = (
        db.fetchall(using, _HELD_SQL, [[p[0] for p in points], [p[1] for p in points]])
        if points
        else []
    )
    found = {(str(run), position): row for run, position, *row in rows}
    reported: set[str] = set()
    for record in held:
        run = record["run"]
        if run in reported:
            continue
        status, generation, count, head = found[(run, record["ledger"])]
        what = (
            f"dispatch of step {record.get('seq')}"
            if record["kind"] == "dispatch"
            else f"end ({record.get('status')})"
        )
        if status is None:
            findings.append(Finding(run, f"witnessed {what}, but the run no longer exists"))
            reported.add(run)
            continue
        problems = []
        if count < record["ledger"]:
            problems.append(f"its ledger has {count} entries, {record['ledger']} were witnessed")
        elif record["ledger"] and head != record["head"]:
            problems.append(f"ledger entry {record['ledger']} is not the witnessed one")
        if generation < record["generation"]:
            problems.append(f"its generation is {generation}, {record['generation']} was witnessed")
        if (
            record["kind"] == "end"
            and record.get("status") in _FINAL
            and status != record["status"]
        ):
            problems.append(f"it is {status} again")
        if problems:
            reported.add(run)
            findings.append(
                Finding(
                    run,
                    f"witnessed {what} is not what the database holds "
                    f"(rolled back or restored): {'; '.join(problems)}",
                )
            )
    return len(records), findings


def purged(run_ids: Iterable[Any]) -> None:
    """Runs deleted by ``purgeworkflows``: their witnessed records are not missing."""
    for run_id in run_ids:
        _tell({"kind": "purged", "run": str(run_id), "generation": 0, "ledger": 0})
