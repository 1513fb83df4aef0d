"""A module imported on first use, for code that a worker process loads but never runs.

``django.setup()`` in a worker imports every installed app's ``admin.py``
(the admin's autodiscovery registers the model admins). The admin's views,
the incident pages' computations, the dry run and the operators' controls
are only ever called by a web request; imported at once they cost every
``runworkflows`` start a tenth of a second. ``admin.py`` reaches them
through ``LazyModule``, which imports on the first attribute read (the
import system's lock makes that safe from any thread) and is then one
dictionary lookup per access.
"""

from __future__ import annotations

import importlib
from typing import Any


class LazyModule:
    """Stands for the module ``name`` until an attribute is read; then imports it."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attribute: str) -> Any:
        return getattr(importlib.import_module(self._name), attribute)

    def __repr__(self) -> str:
        return f"<lazy module {self._name!r}>"
