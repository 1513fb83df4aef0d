"""The soak's workflows: every effect class, waits and fan-out, with countable effects.

``bench/soak.py`` starts a PostgreSQL cluster of its own, runs these workflows on
several worker processes while it kills, freezes and restarts things, and then
checks the invariants from the tables this app writes to.
"""
