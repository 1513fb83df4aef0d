"""The parts of ``bench/soak.py``: its cluster, its processes, its load and its checks.

``bench/soak.py`` is the one entry point; these modules are what it is made of:

- ``cluster``: the PostgreSQL of the soak's own (it restarts it) and the tables
  and triggers the checks read;
- ``processes``: the worker processes and, for the starvation soak, the CPU burners;
- ``load``: the runs and task calls it starts, and the task schedules;
- ``invariants``: what the database shows after the soak, invariant by invariant,
  and the takeovers of live holders;
- ``report``: the table and the JSON line; ``waker``: the process that opens gates.
"""
