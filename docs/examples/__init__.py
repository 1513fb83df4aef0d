"""The documentation's code examples: the pages include them, the test suite runs them.

Each module holds the examples of one topic, marked with ``# --8<-- [start:name]``
and ``[end:name]`` for the pages (pymdownx.snippets). ``tests/docs/test_docs_examples.py``
imports them and runs them against PostgreSQL. The app (label ``docs_examples``)
is installed by the test settings only: its models are the tables the examples
write to, its providers stand in for the payment gateway, mailer and bank.
"""
