"""Declaring test workflows that run one action once."""

from __future__ import annotations

from typing import Any

from k2b_workflows import Action, workflow


def one_step(name: str, action: type[Action], *, app_id: str = "tests", **options: Any) -> None:
    """Register workflow ``name``: run ``action`` once with the input, return its output."""

    def run_action(run: Any, input: Any) -> Any:
        return run.step(action, input)

    run_action.__qualname__ = f"one_step[{name}]"
    workflow(name, app_id=app_id, **options)(run_action)
