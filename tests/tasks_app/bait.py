"""A module no code imports: importing it is seen (#47).

The runtime role names it as a task run's task path (``bait.noop``); no
process may import a path of a row whose start seal does not verify. Its
import sets ``K2B_TEST_BAIT_IMPORTED`` in the environment, which the test reads.
"""

from __future__ import annotations

import os

os.environ["K2B_TEST_BAIT_IMPORTED"] = __name__


def noop() -> None:
    """What the forged path names."""
