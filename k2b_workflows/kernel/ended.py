"""One way a run ends: the seal its end is written with, and what the end tells once it commits.

The failure this module is built around: a run's end was written in three
places (a worker's end in ``ending.RunEnding``, a cancel in
``interventions.cancel``, a start born canceled by its concurrency limit in
``starts``), and each sealed, witnessed and signaled it on its own. They had
already drifted: a run born canceled sent no ``run_finished``, so a
``task_finished`` receiver never heard of a task its limit canceled; a cancel
witnessed before it signaled, a worker's end after. Cancels, forks and batches
add more ends. Every path now writes the seal ``seal`` gives, in the statement
that ends the run, and calls ``told`` in the transaction that writes it.
"""

from __future__ import annotations

import functools
import uuid
from typing import Any

from django.db import transaction

from .. import signals
from . import seals, witness


def seal(
    run_id: uuid.UUID, status: str, error_code: str, generation: int, output_text: str = "null"
) -> str:
    """The end seal (``seals.end_seal``) a run's end is written with, in its own statement."""
    return seals.end_seal(run_id, status, error_code, generation, output_text)


def told(
    using: str,
    *,
    run_id: uuid.UUID,
    workflow_name: str,
    status: str,
    error_code: str,
    generation: int,
    ledger: tuple[int, str | None] = (0, None),
    message: str = "",
    step: int | None = None,
) -> None:
    """Once the transaction that ended the run commits (at once outside one): its signal,
    ``run_needs_attention`` for a run handed to an operator, else ``run_finished``;
    then its witness record (``ledger``: the ledger's length and head as the end saw
    them). A rolled-back end tells nothing."""
    if status == "needs_attention":
        signals.send_on_commit(
            signals.run_needs_attention,
            using,
            run_id=run_id,
            workflow_name=workflow_name,
            error_code=error_code,
            message=message,
            step=step,
        )
    else:
        signals.send_on_commit(
            signals.run_finished,
            using,
            run_id=run_id,
            workflow_name=workflow_name,
            status=status,
            error_code=error_code,
        )
    transaction.on_commit(
        functools.partial(witness.ended, run_id, status, generation, *ledger), using=using
    )


def told_each(using: str, ended: list[tuple[Any, str, int]], status: str, error_code: str) -> None:
    """``told`` for each (run id, workflow name, generation) one statement ended alike."""
    for run_id, workflow_name, generation in ended:
        told(
            using,
            run_id=run_id,
            workflow_name=workflow_name,
            status=status,
            error_code=error_code,
            generation=generation,
        )
